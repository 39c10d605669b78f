#!/usr/bin/env bash
# with-db.sh CMD…: run CMD with DATABASE_URL set. When DATABASE_URL is already set it is used as
# is; otherwise the local cluster in ./.pg is created/started (scripts/pg.sh) and its URL used.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -z ${DATABASE_URL:-} ]]; then
    "$here/pg.sh" start
    DATABASE_URL=$("$here/pg.sh" url)
    export DATABASE_URL
fi
exec "$@"
