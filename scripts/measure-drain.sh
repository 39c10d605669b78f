#!/usr/bin/env bash
# measure-drain.sh [ROWS] [CONCURRENCY] [PROCESSES]: queue ROWS invoice.paid rows (each its own
# invoice) in a fresh database, start PROCESSES release workers with --concurrency CONCURRENCY and
# time the drain until no row is unprocessed. Prints events/s and the commits per event.
# Needs DATABASE_URL (see with-db.sh) and `cargo build --release`. The full benchmark is `make bench`.
set -euo pipefail
rows=${1:-10000} concurrency=${2:-256} processes=${3:-1}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=$root/target/release
db=inbox_drain_$$
. "$root/scripts/scratch-db.sh"
# The workers still running when the script stops (an error, ^C) go before their database.
scratch_db_on_exit() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }
scratch_db "$db" "$bin/inbox-worker"
psql -qAt "$url" <<SQL
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload)
SELECT 'stripe', 'billing', 'evt_' || i, 'invoice.paid',
       jsonb_build_object('id', 'evt_' || i, 'type', 'invoice.paid', 'object', 'event',
         'data', jsonb_build_object('object', jsonb_build_object(
           'id', 'in_' || i, 'object', 'invoice', 'customer', 'cus_' || (i % 1000),
           'amount_paid', 1000 + i, 'currency', 'jpy', 'status', 'paid',
           'lines', jsonb_build_object('data', jsonb_build_array(jsonb_build_object(
             'id', 'il_' || i, 'amount', 1000 + i, 'description', repeat('x', 1200)))))))
  FROM generate_series(1, $rows) i;
SQL
psql -qAt "$url" -c "VACUUM ANALYZE webhook_inbox" >/dev/null
commits0=$(psql -qAt "$url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
start=$(date +%s.%N)
for ((p = 0; p < processes; p++)); do
    DATABASE_URL=$url LOG_FORMAT=json RUST_LOG=warn "$bin/inbox-worker" run --concurrency "$concurrency" --poll-interval 50ms &
done
# Wait inside one session: Debian's psql is a Perl wrapper, and starting it every 50 ms took ~20% of
# a core from the drain being measured.
psql -qAt "$url" -c "DO \$\$ BEGIN
    WHILE EXISTS (SELECT 1 FROM webhook_inbox_queue) LOOP PERFORM pg_sleep(0.05); END LOOP;
END \$\$" >/dev/null
end=$(date +%s.%N)
sleep 0.6 # let pg_stat_database catch up
commits1=$(psql -qAt "$url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
ledger=$(psql -qAt "$url" -c "SELECT count(*) FROM ledger_entries")
awk -v r="$rows" -v s="$start" -v e="$end" -v c0="$commits0" -v c1="$commits1" -v l="$ledger" -v k="$concurrency" -v p="$processes" \
    'BEGIN { printf "drained %d rows in %.2f s: %.0f events/s (%d process(es) x concurrency %d); ledger rows %d; %.2f commits/event\n", r, e - s, r / (e - s), p, k, l, (c1 - c0) / r }'
