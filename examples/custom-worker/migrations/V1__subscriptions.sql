-- custom-worker's own schema, version 1: the subscriptions this product sells.
--
-- Applied by `custom-worker migrate` after the inbox's migrations, and recorded in
-- custom_worker_schema_history (not refinery_schema_history): the two sets grow independently and
-- their version numbers never collide. This file is never edited once applied; changes go in V2.

-- One row per Stripe subscription of this product, written only by the subscription handler
-- (src/subscriptions.rs), inside the worker's transaction that also marks the event processed.
CREATE TABLE subscriptions (
    -- Stripe's subscription id (sub_...): the business key. Every event about a subscription
    -- upserts this row, so duplicates and out-of-order deliveries meet on it.
    id         text        PRIMARY KEY,
    -- Who pays: the customer (cus_...), or under Accounts v2 the customer account (acct_...) when
    -- Stripe leaves `customer` null. Set by the first event seen; a subscription never changes
    -- customer.
    customer   text        NOT NULL,
    -- A coarse stage, not Stripe's status: pending (incomplete: first payment not made yet), live
    -- (the customer has the product: trialing, active, past_due, unpaid, paused), ended (canceled,
    -- incomplete_expired, or deleted). It only moves forward, pending < live < ended, and ended is
    -- terminal, which is what makes it independent of the order Stripe delivers events in.
    -- Statuses that move back and forth (active <-> past_due) are deliberately not stored.
    stage      text        NOT NULL CHECK (stage IN ('pending', 'live', 'ended')),
    -- When the subscription ended (Stripe's ended_at, else canceled_at, else when the ending event
    -- was processed). Set once, by the event that moves the stage to ended, never changed after.
    ended_at   timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Last time an event moved the stage (events that change nothing leave it alone).
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- ended_at is exactly the mark of an ended subscription: a live row with an end date, or an
    -- ended row without one, is a bug in the handler and must fail its transaction, not be stored.
    CONSTRAINT subscriptions_ended_at_iff_ended CHECK ((stage = 'ended') = (ended_at IS NOT NULL))
);

-- "Which subscriptions does this customer have": the lookup a product makes on every request
-- that checks access.
CREATE INDEX subscriptions_customer ON subscriptions (customer);
