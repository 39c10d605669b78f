-- stripe-inbox schema, version 6: every verified body is kept, and each row says how it was verified.
--
-- Kept whatever jsonb thinks of it. A body whose signature verifies is Stripe's; when PostgreSQL's
-- jsonb refuses it (a \u0000 escape, a lone surrogate, nesting deeper than the server's stack) the
-- ingest still stores it, byte for byte, in `raw_body`, with `payload` NULL, and parks the row: an
-- answer of 400 would make Stripe retry for three days and then drop the event without an alert.
--
-- `held`: why the ingest parked a row on arrival, before any worker saw it —
--   'unstorable'  the body is in raw_body, not in payload: nothing a worker could apply;
--   'livemode'    the event's livemode disagrees with the endpoint's declared mode (a test event
--                 sent to a live endpoint must never book into the real ledger).
-- Such a row is parked (parked_at set, last_error says why) and shows in needs-review; requeue
-- --all leaves it, requeue --event-id takes a livemode row (a person decided) and refuses an
-- unstorable one.
--
-- Provenance: which of the endpoint's secrets verified the delivery that stored the row — its
-- position in the endpoint's list (from 0) and a fingerprint (first 8 hex digits of its SHA-256,
-- never the secret) — and the signature's `t` (Unix seconds). During a secret roll, `stats`
-- counts rows per secret, so an operator sees when the old one is no longer used. Rows stored
-- before this version have NULLs: nothing recorded it then.
--
-- Evidence: with `inbox-ingest --keep-raw` (and always for an unstorable body) `raw_body` holds the
-- exact signed bytes and `signature_v1` the `v1` signature that matched (32 bytes: the HMAC, not
-- the secret); `inbox-worker verify --event-id` recomputes it with the configured secrets. Left to
-- the default (pglz) compression: lz4 would cost less CPU, but a server built without it would
-- refuse this migration.
--
-- No CHECK constraint ties these columns together: PostgreSQL prepares a table's check
-- expressions again at every execution of an INSERT, and the ingest's group-commit insert is
-- executed for a few rows at a time. In alternating benchmark runs (the ingest at 32 connections,
-- 2-core machine) its rate was 6-13% lower with such constraints and unchanged without. The claim
-- guards the workers instead: a row without a payload is never processed; a claim that meets one
-- (a hold cleared by hand) parks it again as unstorable.
--
-- Every change below is a catalogue change (new nullable columns without a default, a dropped
-- NOT NULL): no table rewrite and no scan, so migrating a large inbox holds its lock for
-- milliseconds.
ALTER TABLE webhook_inbox
    ALTER COLUMN payload DROP NOT NULL,
    ADD COLUMN raw_body           bytea,
    ADD COLUMN held               text,
    ADD COLUMN secret_position    smallint,
    ADD COLUMN secret_fingerprint text,
    ADD COLUMN signature_t        bigint,
    ADD COLUMN signature_v1       bytea;

-- Invoices billed through Accounts v2 name the payer in `customer_account` and have
-- `customer: null`. An invoice is booked whoever pays it; the ledger never needed the payer.
ALTER TABLE invoices
    ALTER COLUMN customer_id DROP NOT NULL,
    ADD COLUMN customer_account text;
