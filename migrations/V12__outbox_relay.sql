-- stripe-inbox schema, version 12: the outbox is a queue, delivered by `inbox-worker relay`.
--
-- The handlers write outbox rows in the transaction of the business change; the relay delivers
-- them (HTTP or NATS JetStream) and sets published_at. It claims, leases and fences rows exactly
-- as the worker does inbox rows: a claim (its own transaction) counts the attempt and moves
-- available_at to the end of the lease; every later write of the relay — published, failed,
-- handed back — applies only while the row still carries that claim (attempts and available_at
-- as the claim left them), so a relay whose lease ran out can never mark or fail a row another
-- relay now holds.
--
-- Rows written before this version were never delivered by anything here: they are pending now
-- and the first relay delivers them, oldest first. A team that delivered them another way marks
-- them first: UPDATE outbox SET published_at = now() WHERE published_at IS NULL AND created_at < …;
ALTER TABLE outbox
    -- Claims counted; reset to 0 by `requeue --outbox`.
    ADD COLUMN attempts      integer     NOT NULL DEFAULT 0,
    -- When the row may be claimed: now for a new row, the lease's end while a relay holds it, the
    -- retry time after a failure. now() is evaluated once here for the existing rows (no rewrite).
    ADD COLUMN available_at  timestamptz NOT NULL DEFAULT now(),
    -- Grows by one with every claim and is never reset (not even by requeue): each delivery attempt
    -- carries it (inbox-fencing-token), so a receiver with side effects of its own can refuse an
    -- attempt older than one it already took.
    ADD COLUMN fencing_token bigint      NOT NULL DEFAULT 0,
    -- The last failed delivery: the destination's answer or the transport's error, truncated.
    ADD COLUMN last_error    text,
    -- Set when the row's last allowed attempt failed (or the receiver answered 410 Gone): no relay
    -- claims it, and the later rows of its aggregate wait behind it, until `requeue --outbox`.
    ADD COLUMN parked_at     timestamptz;

-- The relay's queue: rows to deliver, by availability. The claim reads the oldest available rows
-- in order; rows leased, waiting for a retry or held back behind their aggregate's first row are
-- past now() and never read.
CREATE INDEX outbox_ready ON outbox (available_at, id)
 WHERE published_at IS NULL AND parked_at IS NULL;

-- The undelivered rows of each aggregate, in id order: whether a candidate is its aggregate's
-- first undelivered row (only that one is delivered, so an aggregate's rows arrive in id order),
-- and the rows to release when that first row is delivered or requeued.
CREATE INDEX outbox_unpublished_by_aggregate ON outbox (aggregate_type, aggregate_id, id)
 WHERE published_at IS NULL;

-- Each row is written three times (inserted, claimed, published) and neither update can be HOT
-- (both change an indexed column or a predicate's): room on the page keeps each new version next
-- to the old one, so its WAL record carries only what changed (see version 2).
ALTER TABLE outbox SET (fillfactor = 70);
