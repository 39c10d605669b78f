#!/usr/bin/env bash
# send-test-event.sh [TYPE] [EVENT_ID]: POST a signed invoice event to the local inbox-ingest.
# Uses INBOX_LISTEN (default 127.0.0.1:8080) and the first endpoint/secret of INBOX_ENDPOINTS
# (default: the development secret `make run` generated in .dev-endpoints).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
type=${1:-invoice.paid}
id=${2:-evt_test_$(date +%s%N)}
endpoints=${INBOX_ENDPOINTS:-$(cat "$here/../.dev-endpoints" 2>/dev/null || true)}
[[ -n $endpoints ]] || { echo "set INBOX_ENDPOINTS=NAME=SECRET or run make run first" >&2; exit 2; }
first=${endpoints%%;*}; name=${first%%=*}; secrets=${first#*=}; secret=${secrets%%,*}
invoice=in_${id#evt_}
body=$(mktemp); trap 'rm -f "$body"' EXIT
cat > "$body" <<JSON
{"id":"$id","object":"event","type":"$type","created":$(date +%s),
 "data":{"object":{"id":"$invoice","object":"invoice","customer":"cus_test","status":"paid",
 "amount_paid":4200,"currency":"jpy"}}}
JSON
sig=$("$here/sign-event.sh" "$secret" "$body")
curl -sS -w ' (HTTP %{http_code})\n' -H "Stripe-Signature: $sig" -H 'Content-Type: application/json' \
    --data-binary @"$body" "http://${INBOX_LISTEN:-127.0.0.1:8080}/webhooks/stripe/$name"
