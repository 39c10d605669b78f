#!/usr/bin/env bash
# measure-purge.sh [ROWS] [RECENT] [BATCH]: time `inbox-worker purge --older-than 30d` over ROWS
# processed rows 40 days old (default 1000000), followed in the table by RECENT rows processed a
# day ago, which it keeps (default ROWS/10), in batches of BATCH rows (default 1000, the purge's).
# Prints the total time and the time of each batch — first, last, median, slowest — then drops
# the database it made.
#
# Each batch is one DELETE statement; a statement-level trigger records when each one ended and
# how many rows it deleted (in purge_timing), so any binary can be measured, including one from
# before a change: a batch's time is from the end of the previous one (the first: from the start
# of the command), so it includes the round trips, the audit record and the commit.
# INBOX_WORKER picks the binary (default target/release/inbox-worker; `cargo build --release`).
# Needs DATABASE_URL of a superuser (see with-db.sh); the payloads are the ~1.4 KB invoice.paid
# bodies of measure-drain.sh. A table of 1M such rows takes ~4 GB (fillfactor 50).
# PURGE_TIMEOUT (seconds, default 3600) stops a purge that takes longer (SIGTERM): the figures
# then cover the batches done so far. DB_SET="name=value" sets a server setting for the database,
# e.g. synchronize_seqscans=off: a sequential scan of a table larger than a quarter of
# shared_buffers starts where the last one is (PostgreSQL's synchronized scans), off is how a
# server whose shared_buffers are four times the table's size scans it.
set -euo pipefail
rows=${1:-1000000} recent=${2:-} batch=${3:-1000}
recent=${recent:-$((rows / 10))}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${INBOX_WORKER:-$root/target/release/inbox-worker}
db=inbox_purge_$$
. "$root/scripts/scratch-db.sh"
scratch_db "$db" "$bin"
if [[ -n ${DB_SET:-} ]]; then
    psql -qAt "$admin" -c "ALTER DATABASE $db SET ${DB_SET%%=*} = '${DB_SET#*=}'" >/dev/null
fi
payload="jsonb_build_object('id', 'evt_' || i, 'type', 'invoice.paid', 'object', 'event',
           'data', jsonb_build_object('object', jsonb_build_object(
             'id', 'in_' || i, 'object', 'invoice', 'customer', 'cus_' || (i % 1000),
             'amount_paid', 1000 + i, 'currency', 'jpy', 'status', 'paid',
             'lines', jsonb_build_object('data', jsonb_build_array(jsonb_build_object(
               'id', 'il_' || i, 'amount', 1000 + i, 'description', repeat('x', 1200)))))))"
psql -qAt "$url" <<SQL
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at, attempts, processed_at)
SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', $payload,
       now() - interval '40 days', 1, now() - interval '40 days' + i * interval '1 ms'
  FROM generate_series(1, $rows) i;
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, received_at, attempts, processed_at)
SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid', $payload,
       now() - interval '1 day', 1, now() - interval '1 day'
  FROM generate_series($rows + 1, $rows + $recent) i;
CREATE TABLE purge_timing (at timestamptz NOT NULL, deleted bigint NOT NULL);
CREATE FUNCTION purge_timing() RETURNS trigger LANGUAGE plpgsql AS \$\$
BEGIN
    INSERT INTO purge_timing SELECT clock_timestamp(), count(*) FROM gone;
    RETURN NULL;
END \$\$;
CREATE TRIGGER purge_timing AFTER DELETE ON webhook_inbox REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION purge_timing();
SQL
psql -qAt "$url" -c "VACUUM ANALYZE webhook_inbox" -c "CHECKPOINT" >/dev/null
size=$(psql -qAt "$url" -c "SELECT pg_size_pretty(pg_table_size('webhook_inbox')) || ', ' ||
                                  pg_relation_size('webhook_inbox') / 8192 || ' pages'")
echo "table: $rows rows to purge + $recent to keep, $size; batch size $batch; $bin${DB_SET:+; $DB_SET}"
psql -qAt "$url" -c "INSERT INTO purge_timing VALUES (clock_timestamp(), -1)" >/dev/null
start=$(date +%s.%N)
set +e
DATABASE_URL=$url LOG_FORMAT=json RUST_LOG=warn timeout "${PURGE_TIMEOUT:-3600}" \
    "$bin" purge --older-than 30d --batch-size "$batch" --actor measure-purge
status=$?
set -e
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" -v c="$status" 'BEGIN { printf "purge exited %d after %.1f s\n", c, e - s }'
psql -qAt "$url" <<'SQL'
CREATE VIEW statements AS -- each statement's time: since the previous one (the first: the start)
SELECT at, deleted, extract(epoch FROM at - lag(at) OVER (ORDER BY at)) * 1000 AS ms
  FROM purge_timing;
CREATE VIEW batches AS -- the statements that deleted rows
SELECT row_number() OVER (ORDER BY at) AS n, count(*) OVER () AS total, deleted, ms
  FROM statements
 WHERE deleted > 0;
SELECT format('%s batches deleted %s rows; %s more statements deleted none, in %s ms in all',
              (SELECT count(*) FROM batches), (SELECT sum(deleted) FROM batches),
              count(*), coalesce(round(sum(ms)::numeric), 0))
  FROM statements WHERE deleted = 0;
SELECT format('per batch: first 10 %s ms, last 10 %s ms, median %s ms, slowest %s ms',
              round(avg(ms) FILTER (WHERE n <= 10)::numeric, 1),
              round(avg(ms) FILTER (WHERE n > total - 10)::numeric, 1),
              round((percentile_cont(0.5) WITHIN GROUP (ORDER BY ms))::numeric, 1),
              round(max(ms)::numeric, 1))
  FROM batches;
SELECT format('mean ms per batch in each tenth of the run: %s', string_agg(m::text, ' ' ORDER BY d))
  FROM (SELECT d, round(avg(ms)::numeric, 1) AS m
          FROM (SELECT ntile(10) OVER (ORDER BY n) AS d, ms FROM batches) AS x
         GROUP BY d) AS y;
SQL
