#!/usr/bin/env bash
# measure-bytes-per-event.sh [COUNT]: the disk an event takes in webhook_inbox, by Stripe event
# type: COUNT events (default 2000) of each of ten types, from ~1 KB to ~7 KB as Stripe sends
# them, each built from the type's resource in Stripe's OpenAPI fixtures
# (tests/fixtures/stripe-openapi/fixtures.json) inside Stripe's event envelope and pretty-printed
# as Stripe sends it. They are inserted into a new, migrated database with the columns the ingest
# writes (without --keep-raw). Prints, per type, the body's size as sent and the bytes per event
# of the heap, its TOAST table (with its index) and the primary key, and how many rows share a
# heap page; then drops the database it made.
#
# A row under PostgreSQL's TOAST threshold (~2 KB) keeps its payload in the row. At the inbox's
# fillfactor (30, room on the page for the claim's and the mark's versions, which makes both HOT
# updates) such a row takes a page to itself. A larger payload goes out of line (compressed, in
# TOAST) and ~11 rows share a page. The heap is sized at insert: a processed row's page keeps its
# room until purge deletes the row.
# INBOX_WORKER picks the binary that migrates (default target/release/inbox-worker; `cargo build
# --release`). Needs DATABASE_URL of a role that may create databases (see with-db.sh).
set -euo pipefail
count=${1:-2000}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${INBOX_WORKER:-$root/target/release/inbox-worker}
. "$root/scripts/scratch-db.sh"
scratch_db "inbox_bytes_$$" "$bin"
python3 - "$root/tests/fixtures/stripe-openapi/fixtures.json" "$count" <<'PY' | psql -qX -v ON_ERROR_STOP=1 "$url"
import json, sys

resources = json.load(open(sys.argv[1]))["resources"]
count = int(sys.argv[2])
# (resource, event type): common types, in order of size.
types = [("product", "product.updated"), ("payout", "payout.paid"), ("customer", "customer.updated"),
         ("payment_method", "payment_method.attached"), ("payment_intent", "payment_intent.succeeded"),
         ("dispute", "charge.dispute.created"), ("checkout.session", "checkout.session.completed"),
         ("charge", "charge.succeeded"), ("invoice", "invoice.paid"),
         ("subscription", "customer.subscription.updated")]
print("CREATE TEMP TABLE sizes (event_type text, sent int, heap bigint, toast bigint, pkey bigint);")
for resource, event_type in types:
    print("TRUNCATE webhook_inbox;")
    values = []
    for i in range(count):
        event = {"id": "evt_%s_%07d" % (resource.replace(".", "_"), i), "object": "event",
                 "api_version": "2024-06-20", "created": 1700000000 + i,
                 "data": {"object": resources[resource]}, "livemode": False, "pending_webhooks": 1,
                 "request": {"id": "req_%014d" % i, "idempotency_key": "%036d" % i}, "type": event_type}
        body = json.dumps(event, indent=2)
        values.append("('stripe', 'default', '%s', '%s', $body$%s$body$::jsonb, %d, 0, 'fp_0123456789abcdef',"
                      " 1700000000, '\\x%s')" % (event["id"], event_type, body, len(body.encode()), "ab" * 32))
    print("INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes,"
          " secret_position, secret_fingerprint, signature_t, signature_v1) VALUES")
    print(",\n".join(values) + ";")
    print("INSERT INTO sizes SELECT '%s', (SELECT avg(payload_bytes)::int FROM webhook_inbox),"
          " pg_relation_size('webhook_inbox'), pg_total_relation_size(reltoastrelid),"
          " pg_relation_size('webhook_inbox_pkey') FROM pg_class WHERE oid = 'webhook_inbox'::regclass;"
          % event_type)
print("""\\pset footer off
SELECT event_type, sent AS "sent, bytes", heap / %(n)d AS "heap B/event", toast / %(n)d AS "TOAST B/event",
       pkey / %(n)d AS "pkey B/event", (heap + toast + pkey) / %(n)d AS "total B/event",
       round(%(n)d / (heap / 8192.0), 1) AS "rows per page"
  FROM sizes ORDER BY sent;""" % {"n": count})
PY
