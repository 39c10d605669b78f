# scratch-db.sh, sourced by the measure-*.sh scripts: `scratch_db NAME BIN` creates the database
# NAME on DATABASE_URL's server, migrates it with the inbox-worker binary BIN and sets `admin` (the
# server's URL) and `url` (the new database's). The database is dropped when the script exits,
# after `scratch_db_on_exit` if the script defines one (to stop what it started in the database).
scratch_db() {
    admin=$DATABASE_URL
    url=${admin%/*}/$1
    psql -qAt "$admin" -c "CREATE DATABASE $1" >/dev/null
    trap "scratch_db_drop $1" EXIT
    DATABASE_URL=$url LOG_FORMAT=json RUST_LOG=warn "$2" migrate >/dev/null
}

scratch_db_drop() {
    if declare -F scratch_db_on_exit >/dev/null; then
        scratch_db_on_exit
    fi
    psql -qAt "$admin" -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" >/dev/null
}
