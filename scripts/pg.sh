#!/usr/bin/env bash
# pg.sh - manage the local PostgreSQL 15 cluster used by `make run/test/bench`.
#
# Usage: scripts/pg.sh <command>
#   start (default)    create the cluster if needed, start it, ensure database `inbox` exists
#   url                print DATABASE_URL value: postgres://postgres@127.0.0.1:<port>/inbox
#   env                print `DATABASE_URL=<url>` (one line, for Makefiles)
#   stop               fast shutdown; no error if not running / not created
#   reset              stop and delete the whole cluster directory
#   status             print `running <url>`, `stopped <url>` or `absent`
#   restart [fast|immediate|smart]   restart (default fast) and wait until ready
#   psql [args...]     run psql against the inbox database as role postgres
#
# The cluster lives in $PGDATA_DIR (default <repo>/.pg): data/ (PGDATA), port (TCP
# port on 127.0.0.1, chosen once, written last = "cluster complete" marker),
# log/postgres.log, lock (flock on fd 9, which is never passed to the server) and the
# unix socket. As root, server commands run as user postgres (runuser); otherwise as
# the current user. Progress goes to stderr; stdout only carries url/env/status output.
set -Eeuo pipefail
trap 'echo "pg.sh: unexpected failure at line $LINENO: $BASH_COMMAND" >&2' ERR

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=$(realpath -m "${PGDATA_DIR:-$ROOT/.pg}")
# As root, the checkout may sit under a directory the postgres user cannot enter (mktemp -d
# makes 0700 ones). Rather than loosen the user's permissions, keep the cluster under /tmp,
# in a directory named after the checkout so each checkout keeps its own cluster.
if [[ -z ${PGDATA_DIR:-} && $(id -u) -eq 0 ]] && ! runuser -u postgres -- test -x "$ROOT" 2>/dev/null; then
    DIR=/tmp/stripe-inbox-pg-$(printf '%s' "$ROOT" | md5sum | cut -c1-12)
fi
DATA=$DIR/data LOG=$DIR/log/postgres.log DB=inbox PORT=

log() { echo "pg.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }
fail() { # die, showing the tail of a log file
    local f=${2:-$LOG}
    [[ -f $f ]] && { log "last lines of $f:"; tail -n 20 "$f" >&2; }
    die "$1"
}
if [[ $(id -u) -eq 0 ]]; then
    as_pg() { (cd / && runuser -u postgres -- "$@") 9>&-; }
else
    as_pg() { "$@" 9>&-; }
fi

exists() { [[ -f $DIR/port && -f $DATA/PG_VERSION ]]; }
running() { [[ -f $DATA/PG_VERSION ]] && as_pg pg_ctl -D "$DATA" status >/dev/null 2>&1; }
need_cluster() { exists || die "no cluster in $DIR (run: scripts/pg.sh start)"; PORT=$(<"$DIR/port"); }
url_str() { echo "postgres://postgres@127.0.0.1:$PORT/$DB"; }
q() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -tAc "$1"; }

LOCKED=
lock() { # flock $DIR/lock; retry if reset deleted the file while we waited
    [[ -n $LOCKED ]] && return 0
    while :; do
        mkdir -p "$DIR"
        exec 9>>"$DIR/lock"
        flock 9
        [[ "$DIR/lock" -ef /dev/fd/9 ]] && { LOCKED=1; return 0; }
        exec 9>&-
    done
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
pick_port() { # sets PORT to a free port in 54320-54999 and records it atomically
    local i base=$RANDOM
    for ((i = 0; i < 680; i++)); do
        PORT=$((54320 + (base + i) % 680))
        if port_free "$PORT"; then
            echo "$PORT" >"$DIR/port.tmp" && mv -f "$DIR/port.tmp" "$DIR/port"
            return 0
        fi
    done
    die "no free TCP port in 54320-54999 on 127.0.0.1"
}

check_access() { # the postgres user must reach and write $DIR
    local d=$DIR
    while [[ $d != / ]]; do
        d=$(dirname "$d")
        as_pg test -x "$d" || die "user $(as_pg id -un) cannot traverse $d (needed for $DIR); chmod o+x it or set PGDATA_DIR"
    done
    as_pg test -w "$DIR" -a -x "$DIR" || die "user $(as_pg id -un) cannot write $DIR"
}

wait_ready() {
    local i
    for ((i = 0; i < 120; i++)); do
        if command -v pg_isready >/dev/null; then
            pg_isready -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres && return 0
        else
            q 'select 1' >/dev/null 2>&1 && return 0
        fi
        sleep 0.5
    done
    fail "server on 127.0.0.1:$PORT not accepting connections after 60s"
}

init_cluster() {
    as_pg rm -rf "$DATA"            # leftover of an interrupted earlier init, if any
    log "creating cluster in $DATA"
    as_pg initdb -D "$DATA" -U postgres -E UTF8 --locale=C --auth=trust --no-instructions \
        >"$DIR/log/initdb.log" 2>&1 || fail "initdb failed" "$DIR/log/initdb.log"
    # trust only unix socket + 127.0.0.1 (initdb's trust would also cover ::1)
    printf '%s\n' 'local all all trust' 'host all all 127.0.0.1/32 trust' \
        'local replication all trust' 'host replication all 127.0.0.1/32 trust' |
        as_pg tee "$DATA/pg_hba.conf" >/dev/null
    echo "include = 'pg_sh.conf'   # written by scripts/pg.sh on every start" |
        as_pg tee -a "$DATA/postgresql.conf" >/dev/null
    pick_port                       # written last: marks the cluster as complete
}

write_conf() { # dev/test box: 2 cores, 24 GiB; fsync/synchronous_commit stay on
    as_pg tee "$DATA/pg_sh.conf" >/dev/null <<EOF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
max_connections = 300
shared_buffers = 512MB
effective_cache_size = 8GB
work_mem = 16MB
max_wal_size = 2GB
log_destination = 'stderr'
logging_collector = off
EOF
}

cmd_start() {
    mkdir -p "$DIR"
    [[ $(id -u) -eq 0 ]] && chown postgres: "$DIR"
    lock
    check_access
    as_pg mkdir -p "$DIR/log"
    exists || init_cluster
    PORT=$(<"$DIR/port")
    if ! running; then
        if ! port_free "$PORT"; then
            log "port $PORT is taken by another process; picking a new one"
            pick_port
        fi
        write_conf
        log "starting server on 127.0.0.1:$PORT (log: $LOG)"
        as_pg pg_ctl -D "$DATA" -l "$LOG" -w -t 60 start >&2 || fail "pg_ctl start failed"
    else
        log "already running on 127.0.0.1:$PORT"
    fi
    wait_ready
    [[ $(q "select 1 from pg_database where datname = '$DB'") == 1 ]] ||
        { log "creating database $DB"; q "create database $DB owner postgres" >/dev/null; }
}

do_stop() { # caller holds the lock
    running || { log "server not running"; return 0; }
    log "stopping server (-m ${1:-fast})"
    as_pg pg_ctl -D "$DATA" -m "${1:-fast}" -w -t 60 stop >&2 || fail "pg_ctl stop failed"
}

cmd_reset() {
    [[ -d $DIR ]] || { log "nothing to reset: $DIR does not exist"; return 0; }
    [[ -n $(find "$DIR" -mindepth 1 -maxdepth 1 ! -name data ! -name log ! -name lock \
        ! -name 'port*' ! -name '.s.PGSQL.*') ]] && die "refusing to delete $DIR: it holds unexpected files"
    lock
    do_stop fast
    log "deleting $DIR"
    rm -rf "$DIR"
}

cmd_restart() {
    local mode=${1:-fast}
    [[ $mode =~ ^(fast|immediate|smart)$ ]] || die "restart mode must be fast, immediate or smart (got: $mode)"
    need_cluster
    lock
    running || { log "server not running; starting it"; cmd_start; return; }
    log "restarting server (-m $mode)"
    as_pg pg_ctl -D "$DATA" -l "$LOG" -m "$mode" -w -t 60 restart >&2 || fail "pg_ctl restart failed"
    wait_ready
}

cmd=${1:-start}
[[ $# -gt 0 ]] && shift
case $cmd in
    start) cmd_start ;;
    url) need_cluster; url_str ;;
    env) need_cluster; echo "DATABASE_URL=$(url_str)" ;;
    stop) if [[ -d $DIR ]]; then lock; do_stop fast; else log "no cluster in $DIR"; fi ;;
    reset) cmd_reset ;;
    restart) cmd_restart "$@" ;;
    status)
        if ! exists; then echo absent
        else PORT=$(<"$DIR/port"); if running; then echo "running $(url_str)"; else echo "stopped $(url_str)"; fi
        fi ;;
    psql)
        need_cluster
        running || die "server not running (run: scripts/pg.sh start)"
        exec psql -d "$(url_str)" "$@" ;;
    -h | --help | help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown command '$cmd' (try: scripts/pg.sh help)" ;;
esac
