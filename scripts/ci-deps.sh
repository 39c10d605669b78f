#!/usr/bin/env bash
# ci-deps.sh: install what the tests need beyond the toolchain and PostgreSQL, from Debian's
# packages: pgbouncer (the transaction-pooling test; it is skipped, saying so, where pgbouncer is
# absent). Installs only what is missing; needs root (or passwordless sudo) to install.
set -euo pipefail
missing=()
command -v pgbouncer >/dev/null 2>&1 || [[ -x /usr/sbin/pgbouncer ]] || missing+=(pgbouncer)
if ((${#missing[@]} == 0)); then
    exit 0
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo -n)
echo "ci-deps.sh: installing ${missing[*]}" >&2
"${sudo[@]}" apt-get update -qq
# No service start: the tests run their own pgbouncer on a free port.
RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
