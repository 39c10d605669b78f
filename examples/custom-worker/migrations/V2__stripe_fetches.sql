-- custom-worker's own schema, version 2: the Stripe objects to fetch because a thin event named them.
--
-- A thin event ("object": "v2.core.event", e.g. v1.billing.meter.error_report_triggered or
-- v2.core.account.updated) carries no snapshot of the object, only its related_object
-- {id, type, url}. The handler (src/thin.rs) must not call Stripe inside the worker's transaction,
-- so it records here, in that transaction, that the object must be fetched; a separate process
-- (README.md, "Thin events") later calls GET https://api.stripe.com{url}, with
-- "Stripe-Context: {account}" when account is set, applies the current object in a transaction of
-- its own and sets fetched_at. V1 is never edited; this is a new version of the same set, recorded
-- in custom_worker_schema_history.

-- One row per Stripe object, whatever the number of events about it: a second event while a
-- fetch is pending needs no second fetch (the fetch reads the object's current state), and one
-- after a fetch queues it again.
CREATE TABLE stripe_fetches (
    -- The related object's id (mtr_..., acct_...): the business key. Every thin event about the
    -- object upserts this row.
    object_id     text        PRIMARY KEY,
    -- The related object's type (billing.meter, v2.core.account): what the fetched object is.
    object_type   text        NOT NULL,
    -- The API path to retrieve it (/v1/billing/meters/mtr_...), as the latest event gave it. Always
    -- a path on api.stripe.com, never a whole URL: the fetcher prefixes https://api.stripe.com.
    url           text        NOT NULL,
    -- The connected account the object belongs to (Connect: the thin event's context, acct_...),
    -- sent as Stripe-Context; NULL for the platform's own objects.
    account       text,
    -- The last event processed about the object (for a person tracing why it was fetched, and
    -- with queued_at the version the fetcher checks before it marks the row fetched).
    last_event_id text        NOT NULL,
    -- When an event last queued the fetch (set again by every event about the object).
    queued_at     timestamptz NOT NULL DEFAULT now(),
    -- When the fetcher last applied the object; NULL while a fetch is due. Every event sets it
    -- back to NULL.
    fetched_at    timestamptz,
    CONSTRAINT stripe_fetches_url_is_a_path CHECK (url LIKE '/%' AND url NOT LIKE '//%')
);

-- What the fetcher reads: the due fetches, oldest first.
CREATE INDEX stripe_fetches_due ON stripe_fetches (queued_at) WHERE fetched_at IS NULL;
