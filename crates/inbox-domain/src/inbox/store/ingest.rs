//! What the ingest writes: verified events, as unprocessed rows, and the workers' wake-up.

use tokio_postgres::types::{ToSql, Type};

use crate::db::Pooler;

use crate::inbox::event::{JsonBytes, RawBytes};

/// Stores verified events as unprocessed rows, unless the same (provider, endpoint, event_id) is
/// already stored: one statement for a whole batch of concurrent requests (group commit). Its
/// transaction has only this statement: when it returns, every row (or the proof it existed) is
/// committed, which is what makes answering 2xx afterwards safe. The caller sends each key at
/// most once per batch.
///
/// A concurrent insert of the same key by another batch waits on the primary key for the first
/// one's outcome: if it commits, this one skips the row; if it rolls back, this one inserts it.
///
/// Parameters: provider, then one array per column: endpoints, event ids, event types, payloads,
/// the payloads' sizes in bytes as received (the workers' memory budget counts them), the reason a
/// row is held on arrival (NULL, or why its `livemode` disagrees with the endpoint: the message a
/// person reads in `needs-review`; a row with one is held as `livemode` and parked from the start,
/// so no worker claims it), and how the delivery was verified: the secret's position and
/// fingerprint and the signature's `t`. Returns the (endpoint, event_id) of the rows inserted; the
/// others were duplicates.
///
/// Every array costs the ingest to encode and PostgreSQL to decode and unnest on the hot path, so
/// the raw bytes and their signature, NULL unless `--keep-raw`, are not sent here but by
/// [`INSERT_EVENTS_RAW_SQL`]. For the same reason the table has no CHECK constraint (see
/// migration V6).
pub const INSERT_EVENTS_SQL: &str = insert_events_sql!("", "", "", "");

/// [`INSERT_EVENTS_SQL`] that also keeps the exact bytes and the `v1` signature that matched
/// (`--keep-raw`): two more arrays, `$11` and `$12`.
pub const INSERT_EVENTS_RAW_SQL: &str = insert_events_sql!(
    ", raw_body, signature_v1",
    ", e.raw_body, e.signature_v1",
    ", $11::bytea[], $12::bytea[]",
    ", raw_body, signature_v1"
);

/// [`INSERT_EVENTS_SQL`] for events `reconcile` found in Stripe's API: the same key, the same
/// deduplication and holds, `source` 'api', and NULL in the signature's arrays (there was none).
pub const INSERT_API_EVENTS_SQL: &str = insert_events_sql!(", source", ", 'api'", "", "");

/// The text of [`INSERT_EVENTS_SQL`], with extra columns, their values, the arrays that carry them
/// and those arrays' names (a constant value needs no array).
macro_rules! insert_events_sql {
    ($columns:literal, $values:literal, $arrays:literal, $aliases:literal) => {
        concat!(
            "\
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, payload, payload_bytes,
                           held, parked_at, last_error, secret_position, secret_fingerprint, signature_t",
            $columns,
            ")
SELECT $1, e.endpoint, e.event_id, e.event_type, e.payload, e.payload_bytes,
       CASE WHEN e.reason IS NOT NULL THEN 'livemode' END, CASE WHEN e.reason IS NOT NULL THEN now() END,
       e.reason, e.secret_position, e.secret_fingerprint, e.signature_t",
            $values,
            "
  FROM unnest($2::text[], $3::text[], $4::text[], $5::jsonb[], $6::int4[],
              $7::text[], $8::int2[], $9::text[], $10::int8[]",
            $arrays,
            ")
       AS e(endpoint, event_id, event_type, payload, payload_bytes,
            reason, secret_position, secret_fingerprint, signature_t",
            $aliases,
            ")
ON CONFLICT (provider, endpoint, event_id) DO NOTHING
RETURNING endpoint, event_id"
        )
    };
}
use insert_events_sql;

/// Stores one verified event whose body PostgreSQL's `jsonb` refused (a `\\u0000` escape, a lone
/// surrogate, nesting deeper than the server's stack): the exact bytes in `raw_body`, no
/// `payload`, held as `unstorable` and parked with `$6`, the server's reason. Its signature was
/// valid, so the body is Stripe's and must not be lost: answering 400 would make Stripe retry for
/// three days and then drop it silently. Same key and deduplication as [`INSERT_EVENTS_SQL`].
/// `$1` provider, `$2` endpoint, `$3` event id, `$4` type, `$5` body, `$6` reason, `$7..$10` the
/// secret's position and fingerprint, the signature's `t` and its `v1` (always kept here: the raw
/// body is the only copy, and the signature is the proof it is Stripe's).
pub const INSERT_UNSTORABLE_SQL: &str = "\
INSERT INTO webhook_inbox (provider, endpoint, event_id, event_type, raw_body, payload_bytes,
                           held, parked_at, last_error, secret_position, secret_fingerprint, signature_t,
                           signature_v1)
VALUES ($1, $2, $3, $4, $5, octet_length($5), 'unstorable', now(), $6, $7, $8, $9, $10)
ON CONFLICT (provider, endpoint, event_id) DO NOTHING
RETURNING endpoint, event_id";

/// Why the ingest parks a row on arrival (the column `held`). Such a row is never claimed; a
/// person decides (see `needs-review`, `requeue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The body is kept in `raw_body`: `jsonb` refused it.
    Unstorable,
    /// The event's `livemode` disagrees with the endpoint's declared mode.
    Livemode,
}

impl Held {
    /// The value of the column.
    pub fn as_str(self) -> &'static str {
        match self {
            Held::Unstorable => "unstorable",
            Held::Livemode => "livemode",
        }
    }
}

/// How a delivery was verified, recorded on the row it stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Provenance<'a> {
    /// Position of the verifying secret in the endpoint's list, from 0.
    pub secret_position: i16,
    /// Its fingerprint (see `signature::fingerprint`), never the secret.
    pub secret_fingerprint: &'a str,
    /// The signature header's `t`.
    pub signature_t: i64,
    /// The `v1` signature that matched (32 bytes).
    pub signature_v1: &'a [u8],
}

/// One event to store.
#[derive(Debug, Clone, Copy)]
pub struct NewEvent<'a> {
    pub endpoint: &'a str,
    pub event_id: &'a str,
    pub event_type: &'a str,
    /// The verified body, stored as `jsonb`.
    pub payload: &'a [u8],
    /// Set when the event's `livemode` disagrees with the endpoint's declared mode: the message
    /// for `needs-review`. The row is then held as [`Held::Livemode`] and parked on arrival.
    pub livemode_hold: Option<&'a str>,
    pub provenance: Provenance<'a>,
}

/// Whether an insert stored a new row or found the event already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    Accepted,
    Duplicate,
    /// Stored as unstorable: `jsonb` refused the body, which is kept in `raw_body`, the row parked.
    /// Answered like an accepted event (it is stored); counted apart.
    Unstorable,
}

impl InsertOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            InsertOutcome::Accepted => "accepted",
            InsertOutcome::Duplicate => "duplicate",
            InsertOutcome::Unstorable => "unstorable",
        }
    }
}

/// Runs [`INSERT_EVENTS_SQL`] (or, with `keep_raw`, [`INSERT_EVENTS_RAW_SQL`]); returns the keys
/// (endpoint, event_id) that were inserted.
///
/// Directly ([`Pooler::None`]) the statement is prepared once per connection and runs in
/// autocommit, bounded by the session's `statement_timeout` (set when the ingest's pool opens the
/// connection): planning the insert at every execution, or wrapping it in BEGIN and COMMIT to set
/// the timeout per transaction, costs PostgreSQL a tenth to a quarter more CPU per request.
/// Behind a transaction pooler ([`Pooler::Transaction`]) no statement or setting survives its
/// transaction: the insert is sent unnamed, in a transaction of its own whose `statement_timeout`
/// (and `lock_timeout`) is `timeout` — BEGIN, the limits, the insert and COMMIT in one write, one
/// round trip.
pub async fn insert_events(
    client: &deadpool_postgres::ClientWrapper,
    pooler: Pooler,
    provider: &str,
    events: &[NewEvent<'_>],
    keep_raw: bool,
    timeout: std::time::Duration,
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    let arrays = EventArrays::new(events.iter().map(|e| EventRow {
        endpoint: e.endpoint,
        event_id: e.event_id,
        event_type: e.event_type,
        payload: e.payload,
        livemode_hold: e.livemode_hold,
        provenance: Some(&e.provenance),
    }));
    let raw: Vec<RawBytes<'_>> =
        if keep_raw { events.iter().map(|e| RawBytes(e.payload)).collect() } else { Vec::new() };
    let v1: Vec<RawBytes<'_>> = if keep_raw {
        events.iter().map(|e| RawBytes(e.provenance.signature_v1)).collect()
    } else {
        Vec::new()
    };
    let mut params = arrays.params(&provider);
    let sql = if keep_raw {
        params.extend([(&raw as &(dyn ToSql + Sync), Type::BYTEA_ARRAY), (&v1, Type::BYTEA_ARRAY)]);
        INSERT_EVENTS_RAW_SQL
    } else {
        INSERT_EVENTS_SQL
    };
    let rows = match pooler {
        Pooler::None => {
            let insert = client.prepare_cached(sql).await?;
            let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
            client.query(&insert, &params).await?
        }
        Pooler::Transaction => super::query_in_own_transaction(client, timeout, sql, &params).await?,
    };
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// One event as the insert's arrays take it: a verified delivery (with its provenance) or an event
/// found in Stripe's API (none).
pub(crate) struct EventRow<'a> {
    pub endpoint: &'a str,
    pub event_id: &'a str,
    pub event_type: &'a str,
    pub payload: &'a [u8],
    pub livemode_hold: Option<&'a str>,
    pub provenance: Option<&'a Provenance<'a>>,
}

/// The arrays `$2`…`$10` of [`INSERT_EVENTS_SQL`] and its variants, one element per event.
pub(crate) struct EventArrays<'a> {
    endpoints: Vec<&'a str>,
    ids: Vec<&'a str>,
    types: Vec<&'a str>,
    payloads: Vec<JsonBytes<'a>>,
    sizes: Vec<i32>,
    reasons: Vec<Option<&'a str>>,
    positions: Vec<Option<i16>>,
    fingerprints: Vec<Option<&'a str>>,
    signed: Vec<Option<i64>>,
}

impl<'a> EventArrays<'a> {
    pub(crate) fn new(rows: impl ExactSizeIterator<Item = EventRow<'a>>) -> Self {
        let n = rows.len();
        let mut arrays = EventArrays {
            endpoints: Vec::with_capacity(n),
            ids: Vec::with_capacity(n),
            types: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            sizes: Vec::with_capacity(n),
            reasons: Vec::with_capacity(n),
            positions: Vec::with_capacity(n),
            fingerprints: Vec::with_capacity(n),
            signed: Vec::with_capacity(n),
        };
        for row in rows {
            arrays.endpoints.push(row.endpoint);
            arrays.ids.push(row.event_id);
            arrays.types.push(row.event_type);
            arrays.payloads.push(JsonBytes(row.payload));
            // Bodies are at most --max-body (far below 2 GiB); saturate rather than wrap all the same.
            arrays.sizes.push(i32::try_from(row.payload.len()).unwrap_or(i32::MAX));
            arrays.reasons.push(row.livemode_hold);
            arrays.positions.push(row.provenance.map(|p| p.secret_position));
            arrays.fingerprints.push(row.provenance.map(|p| p.secret_fingerprint));
            arrays.signed.push(row.provenance.map(|p| p.signature_t));
        }
        arrays
    }

    /// `$1` (`provider`) and the arrays, typed.
    pub(crate) fn params<'p>(&'p self, provider: &'p &'p str) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
        vec![
            (provider, Type::TEXT),
            (&self.endpoints, Type::TEXT_ARRAY),
            (&self.ids, Type::TEXT_ARRAY),
            (&self.types, Type::TEXT_ARRAY),
            (&self.payloads, Type::JSONB_ARRAY),
            (&self.sizes, Type::INT4_ARRAY),
            (&self.reasons, Type::TEXT_ARRAY),
            (&self.positions, Type::INT2_ARRAY),
            (&self.fingerprints, Type::TEXT_ARRAY),
            (&self.signed, Type::INT8_ARRAY),
        ]
    }
}

/// Runs [`INSERT_UNSTORABLE_SQL`] for `event` (its `livemode_hold` is ignored: the row is held
/// as unstorable, with `reason`); returns whether a row was inserted (false: a duplicate). Always
/// unnamed and in a transaction of its own with its limits, whatever the pooler: it is rare.
pub async fn insert_unstorable(
    client: &deadpool_postgres::Object,
    provider: &str,
    event: &NewEvent<'_>,
    reason: &str,
    timeout: std::time::Duration,
) -> Result<bool, tokio_postgres::Error> {
    let (payload, v1) = (RawBytes(event.payload), RawBytes(event.provenance.signature_v1));
    let params: [(&(dyn ToSql + Sync), Type); 10] = [
        (&provider, Type::TEXT),
        (&event.endpoint, Type::TEXT),
        (&event.event_id, Type::TEXT),
        (&event.event_type, Type::TEXT),
        (&payload, Type::BYTEA),
        (&reason, Type::TEXT),
        (&event.provenance.secret_position, Type::INT2),
        (&event.provenance.secret_fingerprint, Type::TEXT),
        (&event.provenance.signature_t, Type::INT8),
        (&v1, Type::BYTEA),
    ];
    let rows = super::query_in_own_transaction(client, timeout, INSERT_UNSTORABLE_SQL, &params).await?;
    Ok(!rows.is_empty())
}

/// Wakes idle workers. Sent by the ingest at most once per short interval, outside the insert
/// transactions (a NOTIFY inside each would serialise their commits). Workers LISTEN with
/// [`super::queue::LISTEN_SQL`].
pub const NOTIFY_SQL: &str = "SELECT pg_notify('webhook_inbox', '')";
