//! What `reconcile` reads and writes: events found in Stripe's API that the inbox lacks, stored
//! by the ingest's own insert ([`super::ingest::INSERT_API_EVENTS_SQL`]), and the runs
//! (`reconcile_runs`) that remember how far a walk through Stripe's event list went, so that an
//! interrupted one resumes (migration V14 says what each column is for).
//!
//! A page is stored in one transaction: its inserts and the run's cursor move together, so a
//! crash between pages repeats no page and skips none. Every write to a run is fenced on its
//! `owner` (the process walking it): a process that stalled past its lease and woke up after
//! another one took the run over changes nothing.

use std::time::Duration;

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;

/// The default lease of a run: renewed every third of it while the process walks (between pages
/// and while it waits for Stripe), so past it the process is taken for dead and another
/// `reconcile` of the endpoint takes the run over.
pub const LEASE: Duration = Duration::from_secs(30);

/// The unfinished run of (`$1` provider, `$2` endpoint, `$3` account), if any, with whether its
/// lease still runs (`$4` the lease in seconds).
pub const UNFINISHED_RUN_SQL: &str = "\
SELECT id, types, created_gte, actor, started_at, starting_after, pages, found, present, inserted, skipped,
       heartbeat_at > now() - make_interval(secs => $4) AS live,
       extract(epoch FROM now() - heartbeat_at)::float8 AS quiet_for
  FROM reconcile_runs
 WHERE provider = $1 AND endpoint = $2 AND account = $3 AND finished_at IS NULL";

/// Starts a run: `$1` provider, `$2` endpoint, `$3` account, `$4` types, `$5` created_gte, `$6`
/// actor, `$7` owner. Nothing when an unfinished run exists (the unique index): the caller reads it
/// again and decides.
pub const START_RUN_SQL: &str = "\
INSERT INTO reconcile_runs (provider, endpoint, account, types, created_gte, actor, owner)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (provider, endpoint, account) WHERE finished_at IS NULL DO NOTHING
RETURNING id";

/// Takes run `$1` over for owner `$2` when its lease ran out (`$3` seconds): the walk resumes at
/// its cursor. Nothing when another process renewed it meanwhile.
pub const TAKE_OVER_SQL: &str = "\
UPDATE reconcile_runs SET owner = $2, heartbeat_at = now()
 WHERE id = $1 AND finished_at IS NULL AND heartbeat_at <= now() - make_interval(secs => $3)
RETURNING id";

/// Closes run `$1` without finishing it (`$2` outcome, e.g. `abandoned`: a new run of another
/// window or filter replaces it), when its lease ran out (`$3` seconds).
pub const ABANDON_SQL: &str = "\
UPDATE reconcile_runs SET finished_at = now(), outcome = $2
 WHERE id = $1 AND finished_at IS NULL AND heartbeat_at <= now() - make_interval(secs => $3)
RETURNING id";

/// Renews the lease of run `$1` owned by `$2`; nothing when it is no longer this owner's.
pub const HEARTBEAT_SQL: &str = "\
UPDATE reconcile_runs SET heartbeat_at = now() WHERE id = $1 AND owner = $2 AND finished_at IS NULL RETURNING id";

/// Gives run `$1` owned by `$2` up without finishing it (the process stops on an error or a
/// signal): its lease ends now, so the next `reconcile` resumes it at once.
pub const RELEASE_SQL: &str = "\
UPDATE reconcile_runs SET heartbeat_at = 'epoch' WHERE id = $1 AND owner = $2 AND finished_at IS NULL";

/// Records a committed page of run `$1` owned by `$2`: the cursor `$3`, and the page's counts
/// (`$4` found, `$5` already present, `$6` inserted, `$7` skipped), renewing the lease. Nothing
/// when the run is no longer this owner's (fenced): the caller stops and its transaction rolls
/// back, inserts included.
pub const PAGE_DONE_SQL: &str = "\
UPDATE reconcile_runs
   SET starting_after = $3, pages = pages + 1, found = found + $4, present = present + $5,
       inserted = inserted + $6, skipped = skipped + $7, heartbeat_at = now()
 WHERE id = $1 AND owner = $2 AND finished_at IS NULL
RETURNING pages, found, present, inserted, skipped";

/// Finishes run `$1` owned by `$2` with outcome `$3` (`complete`); returns its totals.
pub const FINISH_SQL: &str = "\
UPDATE reconcile_runs SET finished_at = now(), outcome = $3, heartbeat_at = now()
 WHERE id = $1 AND owner = $2 AND finished_at IS NULL
RETURNING pages, found, present, inserted, skipped";

/// Which of the event ids `$3` are stored for (`$1` provider, `$2` endpoint): `--dry-run` counts
/// with it. A lookup per id on the primary key.
pub const PRESENT_SQL: &str = "\
SELECT event_id FROM webhook_inbox WHERE provider = $1 AND endpoint = $2 AND event_id = ANY ($3::text[])";

/// An unfinished run, as [`UNFINISHED_RUN_SQL`] reads it.
#[derive(Debug, Clone)]
pub struct Run {
    pub id: i64,
    pub types: Vec<String>,
    pub created_gte: i64,
    pub actor: String,
    pub started_at: std::time::SystemTime,
    pub starting_after: Option<String>,
    pub totals: Totals,
    /// Whether its lease still runs: a process is walking it.
    pub live: bool,
    /// Seconds since its last page.
    pub quiet_for: f64,
}

/// A run's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Totals {
    pub pages: i32,
    /// Events Stripe listed that this run takes (its types; see `skipped`).
    pub found: i64,
    /// Of those, already in the inbox.
    pub present: i64,
    /// Of those, stored by this run.
    pub inserted: i64,
    /// Listed by Stripe but of a type this worker neither handles nor ignores: not stored.
    pub skipped: i64,
}

/// One event to store, as found in the API.
#[derive(Debug, Clone, Copy)]
pub struct ApiEvent<'a> {
    pub event_id: &'a str,
    pub event_type: &'a str,
    /// The event object exactly as Stripe's list returned it.
    pub payload: &'a [u8],
    /// Why it is held on arrival (its livemode disagrees with the endpoint's declared mode).
    pub livemode_hold: Option<&'a str>,
}

/// Runs [`UNFINISHED_RUN_SQL`].
pub async fn unfinished_run(
    client: &(impl GenericClient + Sync),
    provider: &str,
    endpoint: &str,
    account: &str,
    lease: Duration,
) -> Result<Option<Run>, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let params: [(&(dyn ToSql + Sync), Type); 4] =
        [(&provider, Type::TEXT), (&endpoint, Type::TEXT), (&account, Type::TEXT), (&lease, Type::FLOAT8)];
    let row = client.query_typed(UNFINISHED_RUN_SQL, &params).await?.into_iter().next();
    Ok(row.map(|r| Run {
        id: r.get("id"),
        types: r.get("types"),
        created_gte: r.get("created_gte"),
        actor: r.get("actor"),
        started_at: r.get("started_at"),
        starting_after: r.get("starting_after"),
        totals: Totals {
            pages: r.get("pages"),
            found: r.get("found"),
            present: r.get("present"),
            inserted: r.get("inserted"),
            skipped: r.get("skipped"),
        },
        live: r.get("live"),
        quiet_for: r.get("quiet_for"),
    }))
}

/// What a run was started with.
#[derive(Debug, Clone)]
pub struct NewRun<'a> {
    pub provider: &'a str,
    pub endpoint: &'a str,
    pub account: &'a str,
    pub types: &'a [String],
    pub created_gte: i64,
    pub actor: &'a str,
    pub owner: &'a str,
}

/// Runs [`START_RUN_SQL`]: the new run's id, or `None` when an unfinished one exists.
pub async fn start_run(
    client: &(impl GenericClient + Sync),
    run: &NewRun<'_>,
) -> Result<Option<i64>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&run.provider, Type::TEXT),
        (&run.endpoint, Type::TEXT),
        (&run.account, Type::TEXT),
        (&run.types, Type::TEXT_ARRAY),
        (&run.created_gte, Type::INT8),
        (&run.actor, Type::TEXT),
        (&run.owner, Type::TEXT),
    ];
    Ok(client.query_typed(START_RUN_SQL, &params).await?.first().map(|r| r.get(0)))
}

/// Runs [`TAKE_OVER_SQL`]: whether `owner` now holds run `id`.
pub async fn take_over(
    client: &(impl GenericClient + Sync),
    id: i64,
    owner: &str,
    lease: Duration,
) -> Result<bool, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&id, Type::INT8), (&owner, Type::TEXT), (&lease, Type::FLOAT8)];
    Ok(!client.query_typed(TAKE_OVER_SQL, &params).await?.is_empty())
}

/// Runs [`ABANDON_SQL`]: whether run `id` was closed.
pub async fn abandon(
    client: &(impl GenericClient + Sync),
    id: i64,
    outcome: &str,
    lease: Duration,
) -> Result<bool, tokio_postgres::Error> {
    let lease = lease.as_secs_f64();
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&id, Type::INT8), (&outcome, Type::TEXT), (&lease, Type::FLOAT8)];
    Ok(client.query_typed(ABANDON_SQL, &params).await?.len() == 1)
}

/// Stores one page's events for `endpoint` with [`super::ingest::INSERT_API_EVENTS_SQL`] and moves
/// run `run`'s cursor to `cursor` ([`PAGE_DONE_SQL`]), in one transaction of `tx`. `found` counts
/// the events taken, `skipped` those left out by type. Returns the run's totals, or `None` when the
/// run is no longer `owner`'s (nothing is committed then: the caller drops `tx`).
#[allow(clippy::too_many_arguments)]
pub async fn store_page(
    tx: &tokio_postgres::Transaction<'_>,
    provider: &str,
    endpoint: &str,
    events: &[ApiEvent<'_>],
    run: i64,
    owner: &str,
    cursor: &str,
    skipped: i64,
) -> Result<Option<Totals>, tokio_postgres::Error> {
    let arrays = super::ingest::EventArrays::new(events.iter().map(|e| super::ingest::EventRow {
        endpoint,
        event_id: e.event_id,
        event_type: e.event_type,
        payload: e.payload,
        livemode_hold: e.livemode_hold,
        provenance: None,
    }));
    let params = arrays.params(&provider);
    let inserted = if events.is_empty() {
        0
    } else {
        tx.query_typed(super::ingest::INSERT_API_EVENTS_SQL, &params).await?.len() as i64
    };
    let found = events.len() as i64;
    let present = found - inserted;
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&run, Type::INT8),
        (&owner, Type::TEXT),
        (&cursor, Type::TEXT),
        (&found, Type::INT8),
        (&present, Type::INT8),
        (&inserted, Type::INT8),
        (&skipped, Type::INT8),
    ];
    let row = tx.query_typed(PAGE_DONE_SQL, &params).await?.into_iter().next();
    Ok(row.map(|r| Totals {
        pages: r.get(0),
        found: r.get(1),
        present: r.get(2),
        inserted: r.get(3),
        skipped: r.get(4),
    }))
}

/// Runs [`HEARTBEAT_SQL`]: whether the run is still `owner`'s.
pub async fn heartbeat(
    client: &(impl GenericClient + Sync),
    id: i64,
    owner: &str,
) -> Result<bool, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&id, Type::INT8), (&owner, Type::TEXT)];
    Ok(!client.query_typed(HEARTBEAT_SQL, &params).await?.is_empty())
}

/// Runs [`RELEASE_SQL`].
pub async fn release(
    client: &(impl GenericClient + Sync),
    id: i64,
    owner: &str,
) -> Result<(), tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 2] = [(&id, Type::INT8), (&owner, Type::TEXT)];
    client.query_typed(RELEASE_SQL, &params).await?;
    Ok(())
}

/// Runs [`FINISH_SQL`]: the run's totals, or `None` when it is no longer `owner`'s.
pub async fn finish(
    client: &(impl GenericClient + Sync),
    id: i64,
    owner: &str,
    outcome: &str,
) -> Result<Option<Totals>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&id, Type::INT8), (&owner, Type::TEXT), (&outcome, Type::TEXT)];
    let row = client.query_typed(FINISH_SQL, &params).await?.into_iter().next();
    Ok(row.map(|r| Totals {
        pages: r.get(0),
        found: r.get(1),
        present: r.get(2),
        inserted: r.get(3),
        skipped: r.get(4),
    }))
}

/// Runs [`PRESENT_SQL`]: which of `ids` the inbox holds for `endpoint`.
pub async fn present(
    client: &(impl GenericClient + Sync),
    provider: &str,
    endpoint: &str,
    ids: &[&str],
) -> Result<Vec<String>, tokio_postgres::Error> {
    let params: [(&(dyn ToSql + Sync), Type); 3] =
        [(&provider, Type::TEXT), (&endpoint, Type::TEXT), (&ids, Type::TEXT_ARRAY)];
    Ok(client.query_typed(PRESENT_SQL, &params).await?.iter().map(|r| r.get(0)).collect())
}
