#!/usr/bin/env bash
# run.sh: migrate, then run inbox-ingest and inbox-worker in the foreground
# until Ctrl-C. Expects DATABASE_URL (see with-db.sh) and the release binaries.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=$root/target/release
export INBOX_LISTEN=${INBOX_LISTEN:-127.0.0.1:8080}
export LOG_FORMAT=${LOG_FORMAT:-text}
if [[ -z ${INBOX_ENDPOINTS:-} ]]; then
    # A development endpoint `billing` with a secret generated once and kept in .dev-endpoints.
    dev=$root/.dev-endpoints
    [[ -s $dev ]] || printf 'billing=whsec_dev_%s\n' "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" > "$dev"
    INBOX_ENDPOINTS=$(<"$dev")
    generated=1
fi
export INBOX_ENDPOINTS

"$bin/inbox-worker" migrate

pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 0' INT TERM
"$bin/inbox-ingest" & pids+=($!)
"$bin/inbox-worker" run & pids+=($!)
sleep 1
endpoint=${INBOX_ENDPOINTS%%=*}
cat <<INFO

  stripe-inbox is running
    ingest:        http://$INBOX_LISTEN/webhooks/stripe/$endpoint
    DATABASE_URL:  $DATABASE_URL
INFO
[[ -n ${generated:-} ]] && echo "    dev endpoint:  INBOX_ENDPOINTS=$INBOX_ENDPOINTS   (generated; kept in .dev-endpoints)"
cat <<INFO

  send a signed test event:   scripts/send-test-event.sh invoice.paid
  look at the inbox:          psql "$DATABASE_URL" -c 'select event_id, event_type, processed_at from webhook_inbox'
  forward from Stripe:        stripe listen --forward-to $INBOX_LISTEN/webhooks/stripe/$endpoint
                              then restart with INBOX_ENDPOINTS=$endpoint=<the whsec_… stripe listen printed>
  stop:                       Ctrl-C

INFO
wait
