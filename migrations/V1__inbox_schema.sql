-- stripe-inbox schema, version 1.
--
-- The four tables of the seed article (section 4) exactly, plus operator_audit and
-- reconciliation_items. This directory is the only source of the schema; `inbox-worker migrate`
-- applies it (refinery records versions in refinery_schema_history).

-- The inbox: one row per (provider, endpoint, event) that we acknowledged with a 2xx.
-- Who moves rows:
--   inbox-ingest   inserts unprocessed rows (processed_at IS NULL, attempts = 0);
--   worker claim   attempts + 1, available_at = now() + lease (the row is invisible while leased);
--   worker process processed_at = now(), last_error = NULL, in the handler's transaction;
--   worker fail    last_error, available_at = now() + backoff (only while processed_at IS NULL);
--   requeue        parked rows (attempts >= max) back to attempts = 0, available_at = now();
--   purge          deletes processed rows older than the retention.
CREATE TABLE webhook_inbox (
    provider     text        NOT NULL,               -- 'stripe'; keeps providers' id spaces apart
    endpoint     text        NOT NULL,               -- two endpoints receiving one event both process it
    event_id     text        NOT NULL,               -- evt_...
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,               -- the verified JSON as received
    received_at  timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(), -- next time a worker may claim it (lease / backoff)
    attempts     integer     NOT NULL DEFAULT 0,     -- counted at claim time, before any work
    last_error   text,
    processed_at timestamptz,                        -- NULL = not yet applied
    PRIMARY KEY (provider, endpoint, event_id)
)
-- Queue tuning. Every row is updated at least twice (claim, then processed) and the workers scan
-- the partial index below all the time, so:
--  * fillfactor 80 leaves room on each page for the new row versions of those updates, so they
--    stay on the page of the row they replace (page-local pruning reclaims them without a vacuum,
--    and the heap does not grow by one page per update burst);
--  * autovacuum runs after 1% (+1000 rows) of the table changed instead of PostgreSQL's 20%, so
--    dead index entries of claimed/processed rows are removed before they slow the SKIP LOCKED
--    scan; cost delay 1 ms keeps that vacuum quick without starving the ingest;
--  * analyze follows at 2% so the planner keeps using the partial index as the queue grows.
WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

-- The workers' scan: only unprocessed rows, in order of availability.
CREATE INDEX webhook_inbox_unprocessed
    ON webhook_inbox (available_at) WHERE processed_at IS NULL;

CREATE TABLE invoices (
    id          text        PRIMARY KEY,           -- in_...
    customer_id text        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('draft', 'open', 'paid', 'void', 'uncollectible')),
    amount_paid bigint      NOT NULL DEFAULT 0,
    paid_at     timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Notifications for downstream systems, written in the same transaction as the business change.
CREATE TABLE outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);

-- Business-level idempotency: one payment booking per invoice, even when Stripe sends the same
-- fact as two different Event objects (the second line of defence after the inbox key).
CREATE TABLE ledger_entries (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    invoice_id text   NOT NULL,
    kind       text   NOT NULL,
    amount     bigint NOT NULL,
    UNIQUE (invoice_id, kind)
);

-- Every requeue, replay and purge: who did what to how many rows.
CREATE TABLE operator_audit (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,
    action   text        NOT NULL,
    target   jsonb       NOT NULL,
    affected integer     NOT NULL
);

-- Facts a person must look at, e.g. a payment reported for a voided invoice (seed 5.2, point 4).
CREATE TABLE reconciliation_items (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    invoice_id text        NOT NULL,
    event_id   text        NOT NULL,
    reason     text        NOT NULL,
    detail     jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX reconciliation_items_invoice ON reconciliation_items (invoice_id);
