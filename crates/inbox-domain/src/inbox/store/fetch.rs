//! What `inbox-worker fetch` reads and writes besides the queue (which it shares with `run`): the
//! objects its claimed thin events name, and their snapshots (`stripe_object_snapshots`, see
//! migration V15 for why a snapshot serves every event received before its fetch began).

use std::time::SystemTime;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

use super::InboxKey;
use crate::inbox::event::JsonBytes;

/// For each claimed event (`$1` provider, `$2` endpoints, `$3` event ids): the object it names
/// (`related_object`'s id, type and url; NULL when the payload has none), its account (the v1 `account`,
/// else `context`, else '': as `InboxEvent::account` reads it), when it was received, the `as_of` of the object's snapshot (NULL
/// when none), and the database's clock now — the `as_of` of a fetch that starts after this read.
/// One index lookup per event by the primary key, one per object on the snapshots' key.
pub const TARGETS_SQL: &str = "\
SELECT k.endpoint, k.event_id, t.object_id, t.object_type, t.url, t.account, w.received_at, s.as_of,
       statement_timestamp() AS now
  FROM unnest($2::text[], $3::text[]) AS k(endpoint, event_id)
  JOIN webhook_inbox AS w ON w.provider = $1 AND w.endpoint = k.endpoint AND w.event_id = k.event_id
 CROSS JOIN LATERAL (SELECT w.payload #>> '{related_object,id}' AS object_id,
                            w.payload #>> '{related_object,type}' AS object_type,
                            w.payload #>> '{related_object,url}' AS url,
                            COALESCE(w.payload ->> 'account', w.payload ->> 'context', '') AS account) AS t
  LEFT JOIN stripe_object_snapshots AS s ON s.account = t.account AND s.url = t.url";

/// Keeps a fetched object: `$1` account, `$2` url, `$3` id, `$4` type, `$5` the object (NULL: 404),
/// `$6` as_of, `$7` Stripe's request id. A snapshot with a later `as_of` is never replaced by an
/// earlier one (two fetchers racing on one object: the newer view stays).
pub const UPSERT_SNAPSHOT_SQL: &str = "\
INSERT INTO stripe_object_snapshots AS s (account, url, object_id, object_type, object, as_of, request_id)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (account, url) DO UPDATE
   SET object_id = EXCLUDED.object_id, object_type = EXCLUDED.object_type, object = EXCLUDED.object,
       as_of = EXCLUDED.as_of, fetched_at = now(), request_id = EXCLUDED.request_id
 WHERE s.as_of < EXCLUDED.as_of";

/// The snapshot of (`$1` account, `$2` url), for a handler, in its transaction.
pub const SNAPSHOT_SQL: &str = "\
SELECT object::text, as_of, fetched_at, request_id FROM stripe_object_snapshots WHERE account = $1 AND url = $2";

/// What [`TARGETS_SQL`] says of one claimed event.
#[derive(Debug, Clone)]
pub struct Target {
    pub key: InboxKey,
    /// `related_object`: None when the payload does not name one (not a thin event).
    pub object_id: Option<String>,
    pub object_type: Option<String>,
    pub url: Option<String>,
    /// The connected account, '' for the platform's own objects.
    pub account: String,
    pub received_at: SystemTime,
    /// When the object's current snapshot was taken, if there is one.
    pub snapshot_as_of: Option<SystemTime>,
    /// The database's clock at the read.
    pub now: SystemTime,
}

/// Runs [`TARGETS_SQL`] for `keys` (all of provider `provider`).
pub async fn targets(
    client: &(impl GenericClient + Sync),
    provider: &str,
    keys: &[&InboxKey],
) -> Result<Vec<Target>, tokio_postgres::Error> {
    let endpoints: Vec<&str> = keys.iter().map(|k| k.endpoint.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|k| k.event_id.as_str()).collect();
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&provider, Type::TEXT), (&endpoints, Type::TEXT_ARRAY), (&ids, Type::TEXT_ARRAY)];
    let rows = client.query_typed(TARGETS_SQL, &params).await?;
    Ok(rows
        .iter()
        .map(|r| Target {
            key: InboxKey { provider: provider.to_owned(), endpoint: r.get(0), event_id: r.get(1) },
            object_id: r.get(2),
            object_type: r.get(3),
            url: r.get(4),
            account: r.get(5),
            received_at: r.get(6),
            snapshot_as_of: r.get(7),
            now: r.get(8),
        })
        .collect())
}

/// A fetched object to keep.
#[derive(Debug, Clone, Copy)]
pub struct NewSnapshot<'a> {
    pub account: &'a str,
    pub url: &'a str,
    pub object_id: &'a str,
    pub object_type: &'a str,
    /// The object as Stripe sent it; None when Stripe answered 404.
    pub object: Option<&'a [u8]>,
    pub as_of: SystemTime,
    pub request_id: &'a str,
}

/// Runs [`UPSERT_SNAPSHOT_SQL`].
pub async fn keep_snapshot(
    client: &(impl GenericClient + Sync),
    snapshot: &NewSnapshot<'_>,
) -> Result<(), tokio_postgres::Error> {
    let object = snapshot.object.map(JsonBytes);
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&snapshot.account, Type::TEXT),
        (&snapshot.url, Type::TEXT),
        (&snapshot.object_id, Type::TEXT),
        (&snapshot.object_type, Type::TEXT),
        (&object, Type::JSONB),
        (&snapshot.as_of, Type::TIMESTAMPTZ),
        (&snapshot.request_id, Type::TEXT),
    ];
    client.query_typed(UPSERT_SNAPSHOT_SQL, &params).await?;
    Ok(())
}

/// A kept snapshot, as [`SNAPSHOT_SQL`] reads it.
#[derive(Debug, Clone)]
pub struct StoredSnapshot {
    /// The object's JSON; None when Stripe answered 404.
    pub object: Option<String>,
    pub as_of: SystemTime,
    pub fetched_at: SystemTime,
    pub request_id: Option<String>,
}

/// Runs [`SNAPSHOT_SQL`].
pub async fn snapshot(
    client: &(impl GenericClient + Sync),
    account: &str,
    url: &str,
) -> Result<Option<StoredSnapshot>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&account, Type::TEXT), (&url, Type::TEXT)];
    let row = client.query_typed(SNAPSHOT_SQL, &params).await?.into_iter().next();
    Ok(row.map(|r| StoredSnapshot {
        object: r.get(0),
        as_of: r.get(1),
        fetched_at: r.get(2),
        request_id: r.get(3),
    }))
}
