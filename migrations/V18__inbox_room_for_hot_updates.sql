-- stripe-inbox schema, version 18: room on webhook_inbox's pages for HOT updates.
--
-- Since V17 no index of webhook_inbox names a column the claim or the processed mark writes, so
-- both can be HOT updates: the row's new version goes on the same page, no index entry is added,
-- and the old version is pruned from the page by the next access that finds it dead to every
-- snapshot, without vacuum. That needs room on the page for the new version. Measured in the
-- benchmark's drain: with a row of ~2 KB kept whole on its page (fillfactor 50, one or two rows a
-- page), only half the updates found room and the other half moved the row to another page (a
-- copy of the payload in the WAL, new index entries).
--
-- * toast_tuple_target 256: a row longer than PostgreSQL's TOAST threshold (~2 KB; Stripe's events
--   mostly are: an invoice alone is 4–5 KB) keeps only a pointer to its compressed payload in the
--   row, which is then ~250 bytes instead of the whole event. Every update copies the row, so
--   every claim and mark now copies those 250 bytes; the payload is written once, at insert, and
--   read once, by the handler. A shorter row (under ~2 KB) stays whole: PostgreSQL moves values
--   out of line only past its threshold.
-- * fillfactor 30: inserts leave 70% of each page free, so the versions a page's rows make while
--   they are claimed and processed (two each) fit beside them until pruning reclaims the dead ones.
--   The rows are short-lived on their page (purged after the retention), and with payloads out of
--   line a page still holds ~8 rows.
--
-- * lz4 compression of the payload where the server has it (PostgreSQL 14+ built with lz4, as
--   Debian's and the managed services' are): the compression of each stored payload was the
--   largest single item of PostgreSQL's CPU in the soak with Stripe-sized events (pglz_compress,
--   13% of it); lz4 compresses several times faster. A server without lz4 keeps pglz.
--
-- They apply to rows stored from now on; the rows already stored keep their layout until purged.
-- The decision, measured against its alternatives, is in docs/performance.md ("A claim HOT can
-- serve").
ALTER TABLE webhook_inbox SET (fillfactor = 30, toast_tuple_target = 256);
DO $lz4$
BEGIN
    ALTER TABLE webhook_inbox ALTER COLUMN payload SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: webhook_inbox.payload keeps pglz';
END
$lz4$;
