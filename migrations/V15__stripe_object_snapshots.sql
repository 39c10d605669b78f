-- stripe-inbox schema, version 15: the objects thin events name, as `inbox-worker fetch` found them.
--
-- A thin event (API v2, "object": "v2.core.event") carries no copy of the object it is about, only
-- `related_object {id, type, url}` and, for a connected account, `context`. Its handler needs the
-- object as it is now. `inbox-worker fetch` claims those events like `run` claims the others, and
-- before applying a batch fetches each object once (GET url, Stripe-Context: the account), outside
-- any transaction, and keeps the answer here; the handlers then read it in their own transaction
-- (`inbox_worker::fetch::snapshot`). The worker's transaction never waits on Stripe.
--
-- One row per object (the account, '' for the platform's own, and the API path): `as_of` is the
-- database's clock read just before the request went out, so the snapshot shows the object as it
-- was at `as_of` or later, and serves every event received at or before `as_of` — a burst of events
-- about one object waiting together is fetched once; an event received after the fetch began gets
-- a fetch of its own (its change may be newer). `object` NULL: Stripe answered 404 (the object is
-- gone; the handler decides). A fetch never replaces a newer snapshot (`as_of` only grows).
CREATE TABLE stripe_object_snapshots (
    account     text        NOT NULL,
    url         text        NOT NULL,
    object_id   text        NOT NULL,
    object_type text        NOT NULL,
    object      jsonb,
    as_of       timestamptz NOT NULL,
    fetched_at  timestamptz NOT NULL DEFAULT now(),
    request_id  text,
    PRIMARY KEY (account, url)
);
