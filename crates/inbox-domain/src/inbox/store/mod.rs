//! The store: every SQL statement on `webhook_inbox` (and on `operator_audit`, which records what
//! operators did to it), each a documented constant next to the function that runs it and the row
//! type it returns. Whoever runs a statement — the ingest, the worker, an operator command — finds
//! it here, so a change of the table's meaning is made in one place. The business tables belong to
//! the handlers that write them.
//!
//! * [`ingest`]: storing verified events (group commit) and waking the workers;
//! * [`queue`]: the worker's three transactions — claim, lock and mark processed, record failures
//!   (and give back the attempts of claims that never ran or were interrupted);
//! * [`admin`]: what operators read and change — statistics, parked rows, requeue, replay, purge,
//!   the audit trail — and the queue gauges' count;
//! * [`fetch`]: the objects thin events name, fetched by `inbox-worker fetch`, and their
//!   snapshots, which the handlers read;
//! * [`reconcile`]: events found in Stripe's API that the inbox lacks, and the runs of
//!   `reconcile` that find them (resumable);
//! * [`gauges`]: who counts the queue gauges (one worker per interval) and how the others read them;
//! * [`reconciliation`]: the reconciliation items as a person's work — listing them, closing one
//!   (audited), and the count of open ones each worker exports;
//! * [`console`]: what the operator console reads besides the above — the queue's split, the
//!   throughput and latency charts, the parked rows filtered and paged, one event, the audit log.
//! * [`maintenance`]: what the queue tables need after PostgreSQL lost its statistics (a crash
//!   restart): the workers' check that analyses `webhook_inbox`, its queue and `outbox` again; and
//!   which of their indexes a long snapshot left grown, for `reindex` to rebuild.
//!
//! # The states of a row
//! Every unprocessed row is in exactly one of these:
//! * *ready*: not parked and `available_at <= now()` — the next claim may take it (`ready!`);
//! * *leased*: not parked, `available_at > now()`, `last_error IS NULL` — a worker holds it;
//! * *retry_wait*: not parked, `available_at > now()`, `last_error IS NOT NULL` — waiting for its
//!   backoff after a failure (a row claimed again after a failure keeps its `last_error` until it
//!   is processed, so it counts here, not as leased, while in flight);
//! * *parked* (needs review): `parked_at` is set — the worker that ran its last allowed attempt
//!   gave up on it; never claimed again until an operator requeues it (`parked!`). Parked is
//!   a state of the row, not a comparison with somebody's `--max-attempts`: every reader agrees
//!   whatever flags its process was given.
//!
//! The ready and parked conditions are written once, as the macros below, and spliced into every
//! statement that needs them (the claim, the statistics, the gauges, the operator commands). The
//! KEDA scaler's query in `deploy/k8s` is the gauges' count of ready rows; a test holds it to
//! the text of [`admin::KEDA_READY_SQL`].
//!
//! # The queue table
//! The rows that are neither processed nor parked — ready, leased or waiting for a retry — are
//! also in `webhook_inbox_queue` (V17): key, event type, `available_at` and `received_at`, indexed
//! by event type and availability (`webhook_inbox_queue_by_type`). Triggers on `webhook_inbox`
//! keep it (a row enters when stored, follows its `available_at`, leaves when processed, parked or
//! deleted), so every writer — these statements, a team's SQL, a row inserted by hand — keeps it
//! right without naming it. The claim and the gauges read it; everything else reads
//! `webhook_inbox` as before. It exists so that no index of `webhook_inbox` names a column the
//! claim or the processed mark writes: both are HOT updates, in place on their page, with no new
//! index entry (docs/performance.md, "A claim HOT can serve"). The parked rows have their partial
//! index on `webhook_inbox` (`webhook_inbox_parked`, `WHERE parked_at IS NOT NULL`).
//!
//! # Plans
//! The statements the worker runs on the queue ([`queue`]) are sent unnamed (`query_typed`), so
//! PostgreSQL plans each execution for its arguments and the table as it is now. A prepared
//! statement gets a generic plan cached after five executions, and one cached while the queue was
//! small stays when the queue grows: a worker started on an empty queue claimed with a bitmap scan
//! and sort of every ready row and locked and marked with scans of the partial index, so under a
//! backlog each batch read the whole backlog and the worker fell further behind (end-to-end p99
//! of 5 to 12 s in the benchmark). Planning the lock, the mark and the rest once per batch costs
//! far less than that risk (0.06–0.07 ms each). The claims, the worker's and the relay's
//! ([`outbox`]), and the relay's published mark are the exceptions: planning one cost as much as
//! running it, or more, so directly (no transaction pooler) each is prepared once per connection
//! and runs its generic plan under settings that leave the planner one plan, the one it is
//! written for ([`queue::CLAIM_GENERIC_PLANNER_SQL`]). The ingest's insert keeps its prepared
//! statement: its plan has no choice to make.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};

// The two conditions, defined before the submodules so that their statements can splice them.

/// The condition of a *ready* row: unprocessed, not parked, available now; its columns prefixed
/// with `$p` (`"w."`) where a statement reads two tables that have them. A string literal, for
/// `concat!`.
macro_rules! ready {
    () => {
        ready!("")
    };
    ($p:literal) => {
        concat!($p, "processed_at IS NULL AND ", $p, "parked_at IS NULL AND ", $p, "available_at <= now()")
    };
}

/// The condition of a row in the queue but not available now (*leased* or *retry_wait*); columns
/// prefixed with `$p` as in [`ready!`].
macro_rules! waiting {
    () => {
        waiting!("")
    };
    ($p:literal) => {
        concat!($p, "processed_at IS NULL AND ", $p, "parked_at IS NULL AND ", $p, "available_at > now()")
    };
}

/// The condition of a *parked* row: unprocessed, given up on by a worker. A string literal, for
/// `concat!`.
macro_rules! parked {
    () => {
        "processed_at IS NULL AND parked_at IS NOT NULL"
    };
}

/// The condition that a row of event type `$col` (a column, e.g. `"q.event_type"`) is claimed by a
/// live worker — one whose row in `inbox_workers` was refreshed within [`workers::LIVE_FOR`] — or
/// that no worker is live at all (then nobody can tell that a type has no handler: the alerts on
/// workers being down say what is wrong). A string literal, for `concat!`.
macro_rules! claimed_by_a_live_worker {
    ($col:literal) => {
        concat!(
            "(NOT EXISTS (SELECT 1 FROM inbox_workers WHERE seen_at > now() - interval '1 minute')
         OR EXISTS (SELECT 1 FROM inbox_workers AS k
                     WHERE k.seen_at > now() - interval '1 minute'
                       AND (k.claims_all OR ",
            $col,
            " = ANY (k.claims_exact)
                            OR EXISTS (SELECT 1 FROM unnest(k.claims_prefix) AS prefix
                                        WHERE starts_with(",
            $col,
            ", prefix)))))"
        )
    };
}

/// The connected account an event names — `account` (Connect), else a thin event's `context` —
/// read from the payload of the row whose columns are prefixed `$p` (`"w."`, or `""`); NULL when
/// the event names none, and for an unstorable row (no payload). As `admin::PARKED_ROWS_SQL`
/// computes it. A string literal, for `concat!`.
macro_rules! event_account {
    ($p:literal) => {
        concat!(
            "CASE WHEN jsonb_typeof(",
            $p,
            "payload->'account') = 'string' THEN ",
            $p,
            "payload->>'account'
            WHEN jsonb_typeof(",
            $p,
            "payload->'context') = 'string' THEN ",
            $p,
            "payload->>'context' END"
        )
    };
}

/// The rows `requeue --all` is about, after `WHERE`: parked rows of `$1` (provider), of event type
/// `$2` (or any, when NULL), whose `last_error` contains `$3` (a pattern LIKE-escaped by the
/// caller; any, when NULL); and, for the filters of the console's needs-review list (each any when
/// NULL), of endpoint `$4`, held
/// on arrival as `$5` (`unstorable`, `livemode`, `any`; `none`: not held), received more than `$6`
/// seconds before `$now` (the count's time: `now()` in the count, its `as_of` in the batches, so
/// that both see one cutoff), of connected account `$7` (the event's `account`, or a thin event's
/// `context`, as `admin::PARKED_ROWS_SQL` reads it). Shared by `admin::COUNT_PARKED_SQL` and
/// `admin::LOCK_PARKED_SQL`, so that the batches take what the count counted, and by the
/// console's needs-review count and pages (`console::REVIEW_COUNT_SQL`, `REVIEW_PAGE_SQL`), so that
/// the list, its count and a requeue of the listed set agree. A string literal, for `concat!`. The statements are sent
/// unnamed (planned for their arguments): a NULL filter folds away, and the scan stays on
/// `webhook_inbox_parked`.
macro_rules! parked_filters {
    ($now:literal) => {
        concat!(
            "provider = $1 AND ",
            parked!(),
            "
   AND ($2::text IS NULL OR event_type = $2)
   AND ($3::text IS NULL OR last_error ILIKE '%' || $3 || '%')
   AND ($4::text IS NULL OR endpoint = $4)
   AND ($5::text IS NULL OR CASE $5 WHEN 'any' THEN held IS NOT NULL
                                    WHEN 'none' THEN held IS NULL
                                    ELSE held = $5 END)
   AND ($6::float8 IS NULL OR received_at < ",
            $now,
            " - make_interval(secs => $6))
   AND ($7::text IS NULL OR $7 = ",
            event_account!(""),
            ")"
        )
    };
}

/// The fence of every write after a claim, on the inbox and the outbox alike: the row `$row` still
/// carries the claim `$claim` (its `attempts` and `leased_until`, the values the claim wrote). A
/// row claimed again since — after the lease expired, or after an operator requeued it — carries
/// other values, and the write does nothing: it belongs to the newer claim. A string literal, for
/// `concat!`.
macro_rules! fenced {
    ($row:literal, $claim:literal) => {
        concat!(
            $row,
            ".attempts = ",
            $claim,
            ".attempts AND ",
            $row,
            ".available_at = ",
            $claim,
            ".leased_until"
        )
    };
}

pub mod admin;
pub mod console;
pub mod cursor;
pub mod fetch;
pub mod gauges;
pub mod ingest;
pub mod maintenance;
pub mod outbox;
pub mod queue;
pub mod reconcile;
pub mod reconciliation;
pub mod workers;

/// The identity of an inbox row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InboxKey {
    pub provider: String,
    pub endpoint: String,
    pub event_id: String,
}

/// Splits keys into the three column arrays the batch statements take.
pub(crate) fn key_columns<'a>(
    keys: impl Iterator<Item = &'a InboxKey>,
) -> (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>) {
    let mut columns = (Vec::new(), Vec::new(), Vec::new());
    for key in keys {
        columns.0.push(key.provider.as_str());
        columns.1.push(key.endpoint.as_str());
        columns.2.push(key.event_id.as_str());
    }
    columns
}

/// The `backend_flush_after` the pipeline's sessions write with where the server leaves it at
/// PostgreSQL's default, 0 (see [`SESSION_WRITE_BACK_SQL`]). One macro, so that both statements
/// carry the same literal.
macro_rules! write_back {
    () => {
        "256kB"
    };
}

/// The value [`SESSION_WRITE_BACK_SQL`] and [`SET_LIMITS_SQL`] set.
pub const WRITE_BACK: &str = write_back!();

/// Asks the kernel to write out what this session wrote every 256 kB, where nobody chose
/// otherwise: a `backend_flush_after` of 0 (PostgreSQL's default) becomes [`WRITE_BACK`]; a value
/// set for the server, the database or the role (`ALTER ROLE inbox SET backend_flush_after =
/// '2MB'`) is kept.
///
/// Why: an inbox row's page is written when it is evicted from shared buffers, after its insert,
/// claim and mark, and not dirtied again until vacuum or the purge, so nothing is gained by
/// leaving those writes in the kernel's cache. Left there (at 0), they pile up until the kernel's
/// dirty-page expiry (30 s) or the checkpoint's `fsync`, and then go to disk at once, in front of
/// the WAL flushes every commit waits for. At a steady 3500 webhooks/s of ~2 KB, over 150 s, the
/// seconds whose p99 passed 25 ms went from 23–35 to 12–29, and the checkpoint's sync phase from
/// 0.7–1.0 s to 0.3–0.7 s (docs/performance.md, "Write-back of the pipeline's own writes"). The
/// setting is a user-level one: any role may set it for its own session, and it asks for
/// write-back, never for a wait on it.
///
/// Run once per connection where the session is the caller's own (the ingest, the worker and the
/// relay connected directly); behind a transaction pooler each transaction sets it with its limits
/// ([`SET_LIMITS_SQL`]) instead, so that nothing reaches another client's.
///
/// `migrate` gives the database the same value where nobody chose one (migration V22), and every
/// session of the database then starts with it, autovacuum's workers included, which no session
/// statement reaches. These statements cover the pipeline where the database's value could not be
/// set (a migrating role that neither owns the database nor is a superuser).
pub const SESSION_WRITE_BACK_SQL: &str = concat!(
    "SELECT set_config('backend_flush_after', '",
    write_back!(),
    "', false) WHERE current_setting('backend_flush_after') = '0'"
);

/// Bounds of a transaction that works on inbox rows (the worker's process transaction, an
/// operator's), transaction-local: they end with it and never leak into the next use of the
/// connection. `$1` statement_timeout, `$2` lock_timeout, `$3`
/// idle_in_transaction_session_timeout (a client that stalls mid-transaction is cut off and its
/// row locks released). The fourth keeps the session's `backend_flush_after`, or sets
/// [`WRITE_BACK`] for the transaction where it is 0: see [`SESSION_WRITE_BACK_SQL`].
pub const SET_LIMITS_SQL: &str = concat!(
    "\
SELECT set_config('statement_timeout', $1, true),
       set_config('lock_timeout', $2, true),
       set_config('idle_in_transaction_session_timeout', $3, true),
       set_config('backend_flush_after',
                  CASE current_setting('backend_flush_after') WHEN '0' THEN '",
    write_back!(),
    "'
                       ELSE current_setting('backend_flush_after') END, true)"
);

/// The transaction-local limits [`SET_LIMITS_SQL`] sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionLimits {
    /// `statement_timeout` of every statement, handlers' included.
    pub statement_timeout: Duration,
    /// `lock_timeout`, below the statement timeout, for row locks and handlers' locks.
    pub lock_timeout: Duration,
    /// `idle_in_transaction_session_timeout`: a client stalled mid-transaction loses its session.
    pub idle_timeout: Duration,
}

/// Runs [`SET_LIMITS_SQL`], unnamed: no prepare round trip, so it is sent in one write with the
/// statement that follows it (the worker's row locks).
pub async fn set_limits(
    tx: &tokio_postgres::Transaction<'_>,
    limits: &TransactionLimits,
) -> Result<(), tokio_postgres::Error> {
    let millis = |d: Duration| format!("{}ms", d.as_millis().max(1));
    let (statement, lock, idle) =
        (millis(limits.statement_timeout), millis(limits.lock_timeout), millis(limits.idle_timeout));
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&statement, Type::TEXT), (&lock, Type::TEXT), (&idle, Type::TEXT)];
    tx.query_typed(SET_LIMITS_SQL, &params).await?;
    Ok(())
}

/// Runs one unnamed statement in a transaction of its own whose `statement_timeout` and
/// `lock_timeout` are `timeout`: BEGIN, the limits, the statement and COMMIT go out in one write
/// — one round trip, as a bare autocommit statement would be — and nothing outlives the
/// transaction (a transaction pooler may hand the next one another server connection). After a
/// failed statement the COMMIT rolls back, and the connection is outside a transaction. A COMMIT
/// that failed leaves the outcome unknown: an error too.
pub(crate) async fn query_in_own_transaction(
    client: &tokio_postgres::Client,
    timeout: Duration,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    query_in_own_transaction_with(client, timeout, "", sql, params).await
}

/// [`query_in_own_transaction`], with `setup` (statements without parameters, e.g. planner
/// settings local to the transaction; empty for none) run after the limits, in the same write.
pub(crate) async fn query_in_own_transaction_with(
    client: &tokio_postgres::Client,
    timeout: Duration,
    setup: &str,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    in_own_transaction(client, timeout, setup, client.query_typed(sql, params)).await
}

/// [`query_in_own_transaction_with`] for any one statement on `client`, unnamed or prepared:
/// `statement` is its query not yet polled (a `query` or `query_typed` future), sent after BEGIN,
/// the limits and `setup`, in the same write.
pub(crate) async fn in_own_transaction(
    client: &tokio_postgres::Client,
    timeout: Duration,
    setup: &str,
    statement: impl std::future::Future<Output = Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let millis = format!("{}ms", timeout.as_millis().max(1));
    let limits: [(&(dyn ToSql + Sync), Type); 3] =
        [(&millis, Type::TEXT), (&millis, Type::TEXT), (&millis, Type::TEXT)];
    let setup = async {
        if setup.is_empty() {
            Ok(())
        } else {
            client.batch_execute(setup).await
        }
    };
    // Polled in this order, each sends its messages before the next: one write.
    let (_, _, _, rows, commit) = tokio::join!(
        client.batch_execute("BEGIN"),
        client.query_typed(SET_LIMITS_SQL, &limits),
        setup,
        statement,
        client.batch_execute("COMMIT"),
    );
    // A failure of BEGIN or of the limits aborts the transaction and the statement fails too:
    // its error is the one to report.
    let rows = rows?;
    commit?;
    Ok(rows)
}

/// The longest `last_error` stored.
pub const MAX_ERROR_LEN: usize = 1024;

/// Truncates an error message to [`MAX_ERROR_LEN`] bytes on a character boundary.
pub fn truncate_error(message: &str) -> &str {
    if message.len() <= MAX_ERROR_LEN {
        return message;
    }
    let mut end = MAX_ERROR_LEN;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_truncated_on_a_character_boundary() {
        assert_eq!(truncate_error("short"), "short");
        let long = "é".repeat(MAX_ERROR_LEN);
        let cut = truncate_error(&long);
        assert!(cut.len() <= MAX_ERROR_LEN && cut.len() >= MAX_ERROR_LEN - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn the_keda_scaler_counts_the_ready_rows_as_the_claim_defines_them() {
        let manifest = include_str!("../../../../../deploy/k8s/base/worker-scaledobject.yaml");
        let query = admin::KEDA_READY_SQL.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            manifest.contains(&format!("query: \"{query}\"")),
            "deploy/k8s/base/worker-scaledobject.yaml must query exactly `{query}`"
        );
    }
}
