-- stripe-inbox schema, version 13: reconciliation items are work a person can see through to the end.
--
-- `reconciliation_items` (V1) recorded payments on voided invoices for a person to look at, with no
-- way to say that one was dealt with. It now also records what Stripe could not send at all — an
-- event Stripe failed to generate, announced by `v2.core.health.event_generation_failure.resolved`:
-- such an event is in no page of Stripe's List Events, so `inbox-worker reconcile` cannot recover it
-- and only a person re-fetching the object can — and every item can be closed:
--   invoice_id       no longer required: an item may be about another object than an invoice (the
--                    PaymentIntent, subscription, … whose event Stripe failed to generate), or about
--                    an object the event does not name (see crates/inbox-domain/src/health.rs);
--   object_id, object_type, object_url
--                    the object to re-fetch from Stripe, as Stripe names it (`url` is the API path,
--                    e.g. /v1/payment_intents/pi_…); NULL when the event does not say;
--   resolved_at, resolved_by, resolution_note
--                    when the item was closed, by whom and what was done
--                    (`inbox-worker reconciliation resolve`, audited in operator_audit); NULL while
--                    the item is open.
--
-- Catalogue-only, no rewrite: dropping NOT NULL and adding nullable columns without a default change
-- the catalogue alone. Only the CHECK and the two indexes read the table, once each: it holds one row
-- per item, a handful, so the ACCESS EXCLUSIVE lock the first statement takes (held to the end of
-- the migration's transaction) lasts milliseconds.
ALTER TABLE reconciliation_items ALTER COLUMN invoice_id DROP NOT NULL;
ALTER TABLE reconciliation_items
    ADD COLUMN object_id       text,
    ADD COLUMN object_type     text,
    ADD COLUMN object_url      text,
    ADD COLUMN resolved_at     timestamptz,
    ADD COLUMN resolved_by     text,
    ADD COLUMN resolution_note text;

-- An open item has none of the three; a closed one says when, who and what was done.
ALTER TABLE reconciliation_items
    ADD CONSTRAINT reconciliation_items_resolution CHECK (
        (resolved_at IS NULL AND resolved_by IS NULL AND resolution_note IS NULL)
        OR (resolved_at IS NOT NULL AND resolved_by IS NOT NULL AND resolution_note IS NOT NULL)
    );

-- The open items, in the order `inbox-worker reconciliation` lists them, and what every worker
-- counts every few seconds for the gauge inbox_reconciliation_items_open: a closed item leaves the
-- index, so both read only what is still open however long the closed history grows.
CREATE INDEX reconciliation_items_open ON reconciliation_items (id) WHERE resolved_at IS NULL;

-- One item per event Stripe failed to generate, however often its announcement is processed: a
-- redelivery, the same event sent to a second endpoint (its own inbox row), a `replay`. The handler
-- inserts with ON CONFLICT DO NOTHING on this index, which, unlike the NOT EXISTS check of the
-- void-invoice item, also holds between two transactions inserting at the same moment. Partial on
-- the reason: it covers no existing row, so building it cannot fail on an old duplicate.
CREATE UNIQUE INDEX reconciliation_items_event_generation_failure
    ON reconciliation_items (event_id) WHERE reason = 'event_generation_failure';
