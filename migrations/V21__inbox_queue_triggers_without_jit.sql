-- stripe-inbox schema, version 21: the queue table's triggers never compile their statements with
-- JIT.
--
-- PostgreSQL compiles a statement with LLVM when the planner's estimate of its cost passes
-- jit_above_cost (100,000 by default). The trigger's delete of the entries of processed rows
-- (V20) probes the queue's primary key once per row, and the planner costs each probe from the
-- index's size on disk against the entries the last vacuum counted in it. The queue table is as
-- short as the backlog, but its primary key gains two entries per event (the ingest's insert and
-- the claim's non-HOT update) and vacuum frees them only once a minute: at a steady few thousand
-- events a second the index reaches thousands of pages within the minute while the last vacuum
-- counted a few dozen live entries, so each probe is costed at ~2000 (some 500 random page
-- reads), and a mark of 64 rows passed the threshold. Every mark then compiled its delete: 40-67
-- ms for a statement that reads ~200 buffers. In one run of `bench --phases d --e2e-rate 3500
-- --duration 150s` the workers fell up to 4.5 s behind for 20 s (docs/performance.md, "JIT in the
-- queue's triggers").
--
-- Every statement the triggers run is a few index probes or a short scan of the rows a statement
-- changed: none gains from compilation, and every writer of webhook_inbox runs them inside its
-- own transaction. The setting applies to the functions' own statements only, as their other
-- settings do; the callers' sessions keep theirs.
ALTER FUNCTION webhook_inbox_queue_enter() SET jit = off;
ALTER FUNCTION webhook_inbox_queue_follow() SET jit = off;
ALTER FUNCTION webhook_inbox_queue_leave() SET jit = off;
ALTER FUNCTION webhook_inbox_queue_clear() SET jit = off;
