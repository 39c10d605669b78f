#!/usr/bin/env bash
# ci-deps.sh: install what the tests and `make lint` need beyond the toolchain and PostgreSQL:
# cargo-deny from crates.io (`make lint`'s dependency checks; built once, ~5 min on 2 cores); from
# Debian's packages pgbouncer (the transaction-pooling test), nats-server (the relay's JetStream
# tests), and chromium with chromium-driver (the console's browser tests, headless); and from PyPI
# the Standard Webhooks reference library, into target/python-deps (the relay tests verify its
# signatures with it, not with our own code). Tests whose tool is absent are skipped, saying so
# (but the browser tests, which fail instead when CI is set). Installs only what is missing; needs
# root (or passwordless sudo) for apt.
set -euo pipefail
# The version deny.toml is written for.
CARGO_DENY_VERSION=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q " $CARGO_DENY_VERSION\b"; then
    echo "ci-deps.sh: installing cargo-deny $CARGO_DENY_VERSION (cargo install, a few minutes)" >&2
    cargo install cargo-deny --locked --version "$CARGO_DENY_VERSION" --quiet
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# The version the relay tests were written against (it has no dependencies of its own).
STANDARDWEBHOOKS_VERSION=1.1.0
pydeps="$here/../target/python-deps"
if ! PYTHONPATH="$pydeps" python3 -c "import standardwebhooks" 2>/dev/null; then
    echo "ci-deps.sh: installing standardwebhooks $STANDARDWEBHOOKS_VERSION (PyPI) into target/python-deps" >&2
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$pydeps" \
        "standardwebhooks==$STANDARDWEBHOOKS_VERSION"
fi
missing=()
command -v pgbouncer >/dev/null 2>&1 || [[ -x /usr/sbin/pgbouncer ]] || missing+=(pgbouncer)
command -v nats-server >/dev/null 2>&1 || [[ -x /usr/sbin/nats-server ]] || missing+=(nats-server)
command -v chromium >/dev/null 2>&1 || [[ -x /usr/bin/chromium ]] || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || [[ -x /usr/bin/chromedriver ]] || missing+=(chromium-driver)
if ((${#missing[@]} == 0)); then
    exit 0
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo -n)
echo "ci-deps.sh: installing ${missing[*]}" >&2
"${sudo[@]}" apt-get update -qq
# No service start: the tests run their own pgbouncer on a free port.
RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
