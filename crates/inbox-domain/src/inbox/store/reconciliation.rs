//! The reconciliation items as work for a person: listing them, closing one, and counting the open
//! ones for the workers' gauge. The handlers write the items (`invoice`: a payment on a voided
//! invoice; `health`: an event Stripe failed to generate), each next to its own statement; what a
//! person does with them, whoever wrote them, is here.
//!
//! An item is *open* while `resolved_at` is NULL; `inbox-worker reconciliation resolve` closes it
//! with who did it and what was done (the three columns are set together or not at all: the CHECK
//! of migration V13), in the transaction of its `operator_audit` record. The open items are the
//! partial index `reconciliation_items_open`, so listing and counting them never read the closed
//! history.

use std::time::Duration;

use serde::Serialize;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

/// An item's columns as [`ReconciliationItem`] reads them, times as RFC 3339 text in UTC, the
/// table named `r` (a string literal, for `concat!`). The ORDER BY clauses name `r.` columns: the
/// text aliases `created_at` and `resolved_at` would otherwise be what they sort.
macro_rules! item_columns {
    () => {
        "r.id, to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS created_at,
       r.reason, r.invoice_id, r.object_type, r.object_id, r.object_url, r.event_id, r.detail,
       to_char(r.resolved_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS resolved_at,
       r.resolved_by, r.resolution_note
  FROM reconciliation_items AS r"
    };
}

/// The open items, oldest first (`$1` limit). The condition and the order are those of the partial
/// index `reconciliation_items_open` (V13): the scan reads the open items in order and stops at the
/// limit, however many closed ones there are.
pub const OPEN_ITEMS_SQL: &str = concat!(
    "SELECT ",
    item_columns!(),
    "
 WHERE r.resolved_at IS NULL
 ORDER BY r.id
 LIMIT $1"
);

/// Every item (`--all`, `$1` limit): the open ones first, oldest first, then the closed ones, the
/// most recently closed first — what a person looks for after the open ones is what was just done.
/// Reads the table and sorts it: one row per item, a person's history, for an operator command.
pub const ALL_ITEMS_SQL: &str = concat!(
    "SELECT ",
    item_columns!(),
    "
 ORDER BY r.resolved_at IS NOT NULL, r.resolved_at DESC, r.id
 LIMIT $1"
);

/// A reconciliation item, as `inbox-worker reconciliation` lists it (also its JSON document).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReconciliationItem {
    pub id: i64,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// Why a person must look: `payment_on_void_invoice`, `event_generation_failure`.
    pub reason: String,
    /// The invoice it is about, for the invoice handlers' items.
    pub invoice_id: Option<String>,
    /// The object to re-fetch from Stripe (its object tag, id and API path), when known.
    pub object_type: Option<String>,
    pub object_id: Option<String>,
    pub object_url: Option<String>,
    /// The event that made the item.
    pub event_id: String,
    /// What the handler kept for the person (the endpoint, the account, the event's data, …).
    pub detail: serde_json::Value,
    /// RFC 3339, UTC; None while open.
    pub resolved_at: Option<String>,
    pub resolved_by: Option<String>,
    pub resolution_note: Option<String>,
}

impl ReconciliationItem {
    fn from_row(r: &tokio_postgres::Row) -> Self {
        ReconciliationItem {
            id: r.get("id"),
            created_at: r.get("created_at"),
            reason: r.get("reason"),
            invoice_id: r.get("invoice_id"),
            object_type: r.get("object_type"),
            object_id: r.get("object_id"),
            object_url: r.get("object_url"),
            event_id: r.get("event_id"),
            detail: r.get("detail"),
            resolved_at: r.get("resolved_at"),
            resolved_by: r.get("resolved_by"),
            resolution_note: r.get("resolution_note"),
        }
    }
}

/// Runs [`OPEN_ITEMS_SQL`], or [`ALL_ITEMS_SQL`] with `all`.
pub async fn list(
    client: &(impl GenericClient + Sync),
    all: bool,
    limit: i64,
) -> Result<Vec<ReconciliationItem>, tokio_postgres::Error> {
    let sql = if all { ALL_ITEMS_SQL } else { OPEN_ITEMS_SQL };
    let rows = client.query_typed(sql, &[(&limit, Type::INT8)]).await?;
    Ok(rows.iter().map(ReconciliationItem::from_row).collect())
}

/// Locks one item (`$1` id), open or not. FOR UPDATE: of two people resolving the same item at
/// once, the second waits for the first's commit (bounded by the transaction's lock_timeout) and
/// then sees it closed.
pub const LOCK_ITEM_SQL: &str = concat!("SELECT ", item_columns!(), "\n WHERE r.id = $1\n   FOR UPDATE");

/// Runs [`LOCK_ITEM_SQL`]; None when there is no such item.
pub async fn lock_item(
    tx: &(impl GenericClient + Sync),
    id: i64,
) -> Result<Option<ReconciliationItem>, tokio_postgres::Error> {
    let rows = tx.query_typed(LOCK_ITEM_SQL, &[(&id, Type::INT8)]).await?;
    Ok(rows.first().map(ReconciliationItem::from_row))
}

/// Closes one open item (`$1` id): resolved now, by `$2`, with the note `$3` saying what was done.
/// Only an open item: the caller locked it first ([`LOCK_ITEM_SQL`]) and refuses a closed one, and
/// the condition keeps a closed item's record as it was written whatever the caller. Returns when
/// it was closed (RFC 3339, UTC); no row when it was not open.
pub const RESOLVE_SQL: &str = "\
UPDATE reconciliation_items
   SET resolved_at = now(), resolved_by = $2, resolution_note = $3
 WHERE id = $1 AND resolved_at IS NULL
RETURNING to_char(resolved_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS resolved_at";

/// Runs [`RESOLVE_SQL`]; returns when the item was closed, None when it was not open.
pub async fn resolve(
    tx: &(impl GenericClient + Sync),
    id: i64,
    resolved_by: &str,
    note: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&id, Type::INT8), (&resolved_by, Type::TEXT), (&note, Type::TEXT)];
    let rows = tx.query_typed(RESOLVE_SQL, &params).await?;
    Ok(rows.first().map(|r| r.get("resolved_at")))
}

/// The open items, for the gauge `inbox_reconciliation_items_open`: an index-only count of the
/// partial index `reconciliation_items_open`, which holds the open items alone.
pub const OPEN_COUNT_SQL: &str = "SELECT count(*) FROM reconciliation_items WHERE resolved_at IS NULL";

/// Runs [`OPEN_COUNT_SQL`] in a transaction of its own whose statement and lock timeouts are
/// `timeout` (the gauge's interval: a count slower than that is stopped by the server).
///
/// Every worker counts for itself, unlike the queue gauges, which one worker counts per interval
/// into `queue_gauges` for the others to read (`store::gauges`). That sharing pays for a scan of
/// every unprocessed row; this count reads a partial index of the items a person has not closed —
/// a handful — so N workers cost N tiny index reads per interval, less than the shared row's lock
/// and write, and the figure needs no column in `queue_gauges` nor a second reader's code path.
pub async fn open_count(
    client: &tokio_postgres::Client,
    timeout: Duration,
) -> Result<i64, tokio_postgres::Error> {
    let rows = super::query_in_own_transaction(client, timeout, OPEN_COUNT_SQL, &[]).await?;
    Ok(rows.first().map_or(0, |r| r.get(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listings_sort_by_the_columns_not_by_their_text_aliases() {
        for sql in [OPEN_ITEMS_SQL, ALL_ITEMS_SQL] {
            let order = sql.split("ORDER BY").nth(1).expect("an ORDER BY");
            assert!(
                order
                    .split(|c: char| c == ',' || c.is_whitespace())
                    .all(|w| !w.contains("_at") || w.starts_with("r.")),
                "{order}"
            );
        }
    }
}
