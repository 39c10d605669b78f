-- stripe-inbox schema, version 25: autovacuum vacuums the outbox after 1 % of it changed, not 20 %.
--
-- The inbox (V1) and its queue table (V17) are vacuumed after 1 % of their rows changed; the outbox
-- (V12) was left at PostgreSQL's 20 %. It keeps every row for the retention, like the inbox, and
-- each event changes its row three times: the relay's claim and its published mark (neither HOT:
-- both move the row in `outbox_ready`), and the purge's delete. At a high rate that makes no
-- difference (autovacuum comes once a minute either way). Under a long retention at a low one, the
-- outbox was vacuumed only every few purges: until then the space of the purged rows is not in the
-- free space map, so the next rows go to new pages, and `outbox_ready` keeps the claims' and the
-- marks' dead entries. In a model of a 30-day retention with a daily purge (docs/performance.md,
-- "The outbox's vacuum") the outbox at 20 % was vacuumed every second to third purge, and its heap
-- was 4-8 % and (from the third purge on) its indexes 8-23 % larger than at these settings, which
-- had it vacuumed after nine purges of ten.
--
-- The settings are the queue table's (V17), without its cost delay: the outbox is as large as the
-- retention, and its vacuum keeps the server's.
-- Takes a SHARE UPDATE EXCLUSIVE lock for a catalog update: the handlers and the relays go on.
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_vacuum_insert_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02
);
