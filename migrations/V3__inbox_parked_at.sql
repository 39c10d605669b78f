-- stripe-inbox schema, version 3: parked is a state of the row.
--
-- Until now a row was "parked" (never claimed again until an operator requeues it) when its
-- attempts reached the --max-attempts of whoever looked: a worker run with 3 parked it, an
-- operator's `needs-review` with the default 10 did not list it, and the KEDA query had to repeat
-- the number. Now the worker that gives up on a row records it:
--   worker fail    a failure at the worker's attempt limit sets parked_at = now();
--   worker claim   a ready row already at the claiming worker's limit (its last attempt ended
--                  without an outcome: the worker died or lost its lease) is parked, not claimed;
--   requeue        parked_at = NULL, attempts = 0, available_at = now().
-- Every reader — the claim, `stats`, `needs-review`, the gauges, the KEDA query — asks the row,
-- whatever flags its own process has. Rows at their limit from before this version are parked by
-- the first claim that meets them.
ALTER TABLE webhook_inbox ADD COLUMN parked_at timestamptz;  -- NULL = not parked

-- The workers' scan, as before — only rows a worker may claim, in order of availability — minus
-- the parked rows: they would otherwise stay at the front of the scan (their available_at is old)
-- and every claim would step over all of them. The claim and the processed mark change this
-- index's key or predicate, as they changed the old one's; parking and requeue are rare.
--
-- Building it holds a SHARE lock on webhook_inbox (inserts wait, so the ingest answers 503 and
-- Stripe retries) for as long as one scan of the table takes: seconds for a million rows. Run
-- `migrate` of this version at a quiet time, or purge processed rows first.
CREATE INDEX webhook_inbox_queue
    ON webhook_inbox (available_at) WHERE processed_at IS NULL AND parked_at IS NULL;
DROP INDEX webhook_inbox_unprocessed;

-- The parked rows, oldest first, for `needs-review`, `requeue --all` and the gauges: small, and
-- written only when a row is parked or requeued.
CREATE INDEX webhook_inbox_parked
    ON webhook_inbox (received_at) WHERE processed_at IS NULL AND parked_at IS NOT NULL;
