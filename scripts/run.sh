#!/usr/bin/env bash
# run.sh: migrate, then run inbox-ingest and inbox-worker in the foreground
# until Ctrl-C. Expects DATABASE_URL (see with-db.sh) and the release binaries (INBOX_BIN_DIR: others).
# Exits 1, naming the component, when one of them stops at start (the listen port taken, …).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${INBOX_BIN_DIR:-$root/target/release}
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
"$bin/inbox-ingest" & ingest=$!
"$bin/inbox-worker" run & worker=$!
pids=("$ingest" "$worker")

# Running means both started: the ingest answers /healthz and neither has exited. A component
# that stops (the port taken, the database refused) stops this script with its name, not a banner.
alive() { # $1 pid, $2 name, $3 hint: returns while the process runs, else stops everything
    kill -0 "$1" 2>/dev/null && return 0
    local code=0
    wait "$1" || code=$?
    echo "run.sh: $2 stopped at start (exit $code)${3:+: $3}; see its error above" >&2
    kill -TERM "${pids[@]}" 2>/dev/null
    wait 2>/dev/null
    exit 1
}
host=${INBOX_LISTEN%:*}
port=${INBOX_LISTEN##*:}
listen_hint="is $INBOX_LISTEN in use? run with INBOX_LISTEN=127.0.0.1:<another port>"
for _ in $(seq 1 100); do
    alive "$ingest" inbox-ingest "$listen_hint"
    alive "$worker" "inbox-worker run" ""
    if curl -fsS --max-time 1 "http://$host:$port/healthz" 2>/dev/null | grep -q '"ok"'; then
        break
    fi
    sleep 0.1
done
# Answered, but perhaps by another program on that port while ours was still failing to bind.
sleep 0.5
alive "$ingest" inbox-ingest "$listen_hint"
alive "$worker" "inbox-worker run" ""
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
