#!/usr/bin/env bash
# sign-event.sh SECRET FILE: print a Stripe-Signature header value for the body in FILE, signed now
# with SECRET exactly as Stripe does (HMAC-SHA256 over "<t>.<body>", hex).
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 SECRET BODY_FILE" >&2; exit 2; }
t=$(date +%s)
sig=$( { printf '%s.' "$t"; cat "$2"; } | openssl dgst -sha256 -hmac "$1" -r | cut -d' ' -f1)
printf 't=%s,v1=%s\n' "$t" "$sig"
