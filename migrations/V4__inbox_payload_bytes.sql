-- stripe-inbox schema, version 4: the size of each body, for the workers' memory budget.
--
-- A worker holds the payloads of the rows it works on in memory, so it bounds its memory by the
-- bytes in flight (`inbox-worker run --max-bytes-in-flight`), not only by a count of events: a
-- count safe for 2 KB events is not safe for 1 MiB ones. The claim adds up the sizes of the rows
-- it picks and stops at the budget; this column is that size, written by the ingest: the length in
-- bytes of the body as received (the JSON text the worker will read back). Stored sizes
-- (pg_column_size) would not do: a compressible payload takes a fraction of its text on disk.
-- NULL for rows stored before this version: the claim measures those (octet_length of the text).
ALTER TABLE webhook_inbox ADD COLUMN payload_bytes integer;
