//! Group commit: concurrent webhook requests coalesced into one multi-row
//! `INSERT … ON CONFLICT DO NOTHING RETURNING`, each answered only after that commit.
//!
//! Batching is "natural": a writer takes whatever requests are queued when it becomes free, so a
//! lone request is written at once (no timer) and under load the batches grow while the previous
//! commits are in flight. Up to `writers` batches are in flight at once, but a batch only starts
//! while another one is in flight once [`JOIN_AT`] requests wait for it: a commit of five rows
//! costs PostgreSQL nearly what one of thirty does, so at moderate rates one writer at a time takes
//! everything that arrived during the previous commit, and the others join as the queue grows.
//! Connected directly, every batch is written on one connection (see `Lane`): a batch started
//! while another is in flight is sent behind it, and the server runs it the moment the first has
//! committed. Behind a transaction pooler each batch takes a pooled connection of its own.
//! A failed batch answers 503 to each of its requests; a batch refused
//! for its data (see `BatchError::Refused`: the same rows fail on every retry) is retried one row
//! at a time, so one poison request never fails its neighbours. A single body that `jsonb`
//! refuses is stored all the same, byte for byte, held as unstorable and parked (see
//! `store::ingest::INSERT_UNSTORABLE_SQL`): its signature was valid, so it is Stripe's.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::web::Bytes;
use deadpool_postgres::{Object, Pool};
use inbox_domain::budget::BytesHeld;
use inbox_domain::db::{DatabaseConfig, OutageLog, Pooler};
use inbox_domain::inbox::store::ingest::{self as store, InsertOutcome, NewEvent, Provenance};
use inbox_domain::PROVIDER_STRIPE;
use tokio::sync::{mpsc, oneshot, Mutex, Notify};
use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use crate::error::IngestError;
use crate::metrics::Metrics;
use crate::readiness::Readiness;

/// A verified event waiting for its batch.
struct Pending {
    endpoint: String,
    event_id: String,
    event_type: String,
    payload: Bytes,
    /// Set when the event's livemode disagrees with its endpoint: the message for `needs-review`.
    livemode_hold: Option<String>,
    secret_position: i16,
    secret_fingerprint: Arc<str>,
    signature_t: i64,
    signature_v1: [u8; 32],
    reply: oneshot::Sender<Result<InsertOutcome, IngestError>>,
    /// The payload's share of the bytes in flight (taken before its first byte was read), given
    /// back when the batch is written — not when the request gives up waiting: the payload stays
    /// queued until then.
    _held: BytesHeld,
}

/// The most requests written by one statement.
pub const MAX_BATCH: usize = 256;

/// Requests that must be waiting before a batch starts while another one is being written.
pub const JOIN_AT: usize = 16;

/// What the writers share.
struct Writers {
    /// The waiting requests; the writer holding the lock is the next to start a batch.
    queue: Mutex<mpsc::Receiver<Pending>>,
    /// Batches being written now: the next batch waits for [`JOIN_AT`] requests while this is
    /// above zero.
    writing: AtomicUsize,
    /// Raised when a batch is done and when the queue reaches [`JOIN_AT`]: wakes the writer that
    /// holds the queue and waits to start.
    changed: Notify,
}

/// Handle to the batch writers; cloning shares them.
#[derive(Clone)]
pub struct Batcher {
    queue: mpsc::Sender<Pending>,
    writers: Arc<Writers>,
}

impl Batcher {
    /// Starts `writers` writer tasks on the current runtime, writing to `target`. They stop when
    /// every handle is dropped.
    pub fn start(target: Target, writers: usize, metrics: Metrics) -> Batcher {
        let (queue, rx) = mpsc::channel(MAX_BATCH * writers.max(1) * 4);
        let shared =
            Arc::new(Writers { queue: Mutex::new(rx), writing: AtomicUsize::new(0), changed: Notify::new() });
        let lane = Arc::new(Lane::default());
        for _ in 0..writers.max(1) {
            tokio::spawn(writer(shared.clone(), target.clone(), lane.clone(), metrics.clone()));
        }
        Batcher { queue, writers: shared }
    }

    /// Stores one event; resolves once its batch committed (or failed). `held` is the payload's
    /// room in the bytes in flight, kept until the batch is written: a slow database fills the
    /// budget, and new requests then wait for room (and 503) instead of the process growing.
    pub async fn insert(
        &self,
        event: Verified<'_>,
        payload: Bytes,
        held: BytesHeld,
    ) -> Result<InsertOutcome, IngestError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            endpoint: event.endpoint.to_owned(),
            event_id: event.event_id.to_owned(),
            event_type: event.event_type.to_owned(),
            payload,
            livemode_hold: event.livemode_hold,
            secret_position: event.secret_position,
            secret_fingerprint: event.secret_fingerprint,
            signature_t: event.signature_t,
            signature_v1: event.signature_v1,
            reply,
            _held: held,
        };
        self.queue.send(pending).await.map_err(|_| IngestError::Unavailable("shutting down".into()))?;
        if self.queue.max_capacity() - self.queue.capacity() >= JOIN_AT - 1 {
            // With the one a waiting writer already holds, enough for a batch beside the others.
            self.writers.changed.notify_one();
        }
        answer.await.map_err(|_| IngestError::Unavailable("writer stopped".into()))?
    }
}

/// A verified event, as the route hands it to [`Batcher::insert`].
pub struct Verified<'a> {
    pub endpoint: &'a str,
    pub event_id: &'a str,
    pub event_type: &'a str,
    /// Set when the row must be parked on arrival because its livemode disagrees with the
    /// endpoint's declared mode: the message for `needs-review`.
    pub livemode_hold: Option<String>,
    /// Position of the verifying secret in the endpoint's list, from 0.
    pub secret_position: i16,
    pub secret_fingerprint: Arc<str>,
    /// The signature header's `t`.
    pub signature_t: i64,
    /// The `v1` signature that matched.
    pub signature_v1: [u8; 32],
}

impl Pending {
    fn row(&self) -> NewEvent<'_> {
        NewEvent {
            endpoint: &self.endpoint,
            event_id: &self.event_id,
            event_type: &self.event_type,
            payload: &self.payload,
            livemode_hold: self.livemode_hold.as_deref(),
            provenance: Provenance {
                secret_position: self.secret_position,
                secret_fingerprint: &self.secret_fingerprint,
                signature_t: self.signature_t,
                signature_v1: &self.signature_v1,
            },
        }
    }
}

/// Where and how the writers store: built by the service at start.
#[derive(Clone)]
pub struct Target {
    pub pool: Pool,
    pub pooler: Pooler,
    /// Where the pool connects: to cancel the statement of a connection abandoned after a
    /// missed deadline (see `checkout`).
    pub database: DatabaseConfig,
    /// Bound on a connection plus the insert, and the insert's server-side statement timeout.
    pub timeout: Duration,
    /// Keep the exact bytes and the matching signature of every row (`--keep-raw`).
    pub keep_raw: bool,
    /// Told of a misconfiguration an insert meets, so that `/readyz` says it.
    pub readiness: Arc<Readiness>,
    /// One line when the database starts failing, one when it answers again.
    pub outage: Arc<OutageLog>,
}

async fn writer(shared: Arc<Writers>, target: Target, lane: Arc<Lane>, metrics: Metrics) {
    loop {
        let (_writing, batch) = {
            let mut rx = shared.queue.lock().await;
            let Some(first) = rx.recv().await else { return };
            // Another batch is being committed: let this one grow until that commit is done or
            // enough requests wait to be worth a commit of their own. Every batch in flight ends
            // by raising `changed`, so this wait always ends.
            while shared.writing.load(Ordering::Acquire) > 0 && rx.len() + 1 < JOIN_AT {
                shared.changed.notified().await;
            }
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            (Writing::start(&shared), batch)
        };
        metrics.batch(batch.len());
        write(&target, &lane, batch).await;
    }
}

/// One batch in flight, counted in [`Writers::writing`] until dropped (even by a panic).
struct Writing<'a>(&'a Writers);

impl<'a> Writing<'a> {
    fn start(shared: &'a Writers) -> Self {
        shared.writing.fetch_add(1, Ordering::AcqRel);
        Writing(shared)
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.writing.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_one();
    }
}

/// Writes one batch and answers every request in it.
async fn write(target: &Target, lane: &Lane, batch: Vec<Pending>) {
    // One row per key: the first request of a key decides, the others are its duplicates.
    let mut first_of: HashMap<(&str, &str), usize> = HashMap::new();
    let mut rows = Vec::with_capacity(batch.len());
    for (i, p) in batch.iter().enumerate() {
        if *first_of.entry((p.endpoint.as_str(), p.event_id.as_str())).or_insert(i) == i {
            rows.push(p.row());
        }
    }
    let result = insert(target, lane, &rows).await;
    let answers: Vec<Result<InsertOutcome, IngestError>> = match result {
        Ok(inserted) => batch
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let key = (p.endpoint.clone(), p.event_id.clone());
                let first = first_of[&(p.endpoint.as_str(), p.event_id.as_str())] == i;
                Ok(if first && inserted.contains(&key) {
                    InsertOutcome::Accepted
                } else {
                    InsertOutcome::Duplicate
                })
            })
            .collect(),
        Err(BatchError::Refused { .. }) if rows.len() > 1 => {
            // One poison request must not fail its neighbours on every retry: each row on its own.
            let mut answers = Vec::with_capacity(batch.len());
            for (i, p) in batch.iter().enumerate() {
                let first = first_of[&(p.endpoint.as_str(), p.event_id.as_str())] == i;
                answers.push(store_one(target, lane, &p.row(), first).await);
            }
            answers
        }
        Err(refused @ BatchError::Refused { .. }) => {
            let first = &batch[0];
            vec![keep_refused(target, &first.row(), refused).await]
        }
        Err(e) => {
            let e: IngestError = e.into();
            batch.iter().map(|_| Err(e.clone())).collect()
        }
    };
    for (p, answer) in batch.into_iter().zip(answers) {
        // The requester may have timed out and gone: nothing to do then.
        let _ = p.reply.send(answer);
    }
}

/// How one row is answered when written on its own: stored, a duplicate, or kept as unstorable.
async fn store_one(
    target: &Target,
    lane: &Lane,
    row: &NewEvent<'_>,
    first: bool,
) -> Result<InsertOutcome, IngestError> {
    match insert(target, lane, std::slice::from_ref(row)).await {
        Ok(inserted) if first && !inserted.is_empty() => Ok(InsertOutcome::Accepted),
        Ok(_) => Ok(InsertOutcome::Duplicate),
        Err(refused @ BatchError::Refused { .. }) => keep_refused(target, row, refused).await,
        Err(e) => Err(e.into()),
    }
}

/// A single row PostgreSQL refused. When `jsonb` refused the body (class 22: a `\u0000`, a lone
/// surrogate; 54001: nested deeper than the server's stack) the body is kept byte for byte and
/// the row parked: the signature was valid, so it is Stripe's, and a 4xx would only make Stripe
/// retry it for three days and drop it. Any other refusal is ours (a constraint of the table):
/// 503, so the event is delivered again once it is fixed.
async fn keep_refused(
    target: &Target,
    row: &NewEvent<'_>,
    refused: BatchError,
) -> Result<InsertOutcome, IngestError> {
    let BatchError::Refused { sqlstate, message, body } = refused else {
        return Err(refused.into());
    };
    if !body {
        tracing::error!(sqlstate, message, "insert refused by a constraint of the inbox table");
        return Err(IngestError::Unavailable("database refused the row".into()));
    }
    let reason = format!("unstorable: PostgreSQL refused the body as jsonb: {message} (SQLSTATE {sqlstate}); the exact bytes are in raw_body");
    let reason = inbox_domain::inbox::store::truncate_error(&reason);
    let deadline = Instant::now() + target.timeout;
    let client = checkout(target, deadline).await.map_err(IngestError::Unavailable)?;
    let stored = async |client: &mut Object| {
        store::insert_unstorable(client, PROVIDER_STRIPE, row, reason, target.timeout).await
    };
    match inbox_domain::db::within(client, deadline, &target.database, stored).await {
        Some((_, Ok(true))) => {
            tracing::warn!(sqlstate, "verified body refused by jsonb: kept in raw_body and parked");
            Ok(InsertOutcome::Unstorable)
        }
        Some((_, Ok(false))) => Ok(InsertOutcome::Duplicate),
        Some((_, Err(e))) => Err(failed(target, &e, "storing an unstorable body failed").into()),
        None => Err(IngestError::Unavailable("timed out storing the unstorable body".into())),
    }
}

#[derive(Debug, Clone)]
enum BatchError {
    /// PostgreSQL refused the rows themselves: the same rows fail on every retry. `body`: the
    /// refusal is `jsonb`'s judgement of a payload (class 22, or 54001 for nesting deeper than the
    /// server's stack) rather than one of the table's constraints (class 23, other class 54).
    Refused { sqlstate: String, message: String, body: bool },
    /// Anything else: a retry may pass. The cause, for the logs.
    Unavailable(Cow<'static, str>),
}

impl From<BatchError> for IngestError {
    fn from(e: BatchError) -> Self {
        match e {
            BatchError::Refused { .. } => IngestError::Unavailable("database refused the row".into()),
            BatchError::Unavailable(cause) => IngestError::Unavailable(cause),
        }
    }
}

/// Inserts a batch within `--db-timeout`, the wait for a connection included.
async fn insert(
    target: &Target,
    lane: &Lane,
    rows: &[NewEvent<'_>],
) -> Result<HashSet<(String, String)>, BatchError> {
    let unavailable = |cause: Cow<'static, str>| {
        target.outage.failed("storing a batch", &cause);
        BatchError::Unavailable(cause)
    };
    let deadline = Instant::now() + target.timeout;
    let stored = async |client: &deadpool_postgres::ClientWrapper| {
        store::insert_events(client, target.pooler, PROVIDER_STRIPE, rows, target.keep_raw, target.timeout)
            .await
    };
    // The statement's outcome, `None` when it had no answer by the deadline, and the lane's
    // connection it ran on (when connected directly).
    let (outcome, on_lane) = if target.pooler == Pooler::None {
        let client = lane.connection(target, deadline).await.map_err(unavailable)?;
        let outcome = tokio::time::timeout_at(deadline, stored(&client)).await.ok();
        if outcome.is_none() {
            // The network may have dropped the connection without a word; the batches already
            // queued behind this one end on it, finished or failed.
            inbox_domain::db::cancel(client.cancel_token(), &target.database);
        }
        (outcome, Some(client))
    } else {
        let client = checkout(target, deadline).await.map_err(unavailable)?;
        let outcome =
            inbox_domain::db::within(client, deadline, &target.database, async |c| stored(c).await).await;
        (outcome.map(|(_, outcome)| outcome), None)
    };
    let result = match outcome {
        Some(Ok(inserted)) => {
            target.outage.succeeded();
            Ok(inserted.into_iter().collect())
        }
        Some(Err(e)) => Err(classify(target, e)),
        // The outcome is unknown: 503, and Stripe's retry meets `ON CONFLICT`.
        None => Err(unavailable(timed_out(target))),
    };
    // A refusal of the rows leaves the lane's session as it was; anything else may have ended it
    // (a terminated backend, a lost connection, a statement with no answer in time), and no later
    // batch is sent on it: the next takes a new one.
    if let (Some(client), Err(BatchError::Unavailable(_))) = (&on_lane, &result) {
        lane.give_up(client);
    }
    result
}

/// The one connection every batch is written on when the ingest reaches PostgreSQL directly.
///
/// A batch that starts while another is in flight (once [`JOIN_AT`] requests wait) is sent on
/// this connection behind it, without waiting for its answer (the protocol's pipelining): the
/// server runs it the moment the first has committed, in a transaction of its own, and answers it
/// after its own commit. On separate connections the two ran side by side, extending the same
/// table and adding to the same index pages under PostgreSQL's locks, and a batch sent only after
/// the previous answer left the server idle for a round trip: one connection gave 22–37 % more
/// requests a second at 32 connections in alternated runs (docs/performance.md, "One connection,
/// batches sent behind each other").
///
/// Behind a transaction pooler every batch takes a pooled connection of its own: there a batch is
/// an explicit transaction, and the pooler hands each transaction whichever server connection is
/// free.
#[derive(Default)]
struct Lane {
    /// The connection, checked out of the pool; `None` before the first batch and after one was
    /// given up. Given up, it is closed once the last batch on it is done, never handed back to
    /// the pool with statements still queued on it.
    current: std::sync::Mutex<Option<Arc<LaneConnection>>>,
    /// Held while a connection is being checked out, so that the writers wait for one instead of
    /// each opening its own.
    opening: Mutex<()>,
}

/// A connection of the [`Lane`]: closed and taken out of the pool when the last batch on it lets
/// go of it.
struct LaneConnection(Option<Object>);

impl std::ops::Deref for LaneConnection {
    type Target = deadpool_postgres::ClientWrapper;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("present until dropped")
    }
}

impl Drop for LaneConnection {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            inbox_domain::db::discard(client);
        }
    }
}

impl Lane {
    /// The lane's connection, checked out of the pool (until `deadline`) when it has none or the
    /// server closed it.
    async fn connection(
        &self,
        target: &Target,
        deadline: Instant,
    ) -> Result<Arc<LaneConnection>, Cow<'static, str>> {
        if let Some(client) = self.open() {
            return Ok(client);
        }
        let _opening =
            tokio::time::timeout_at(deadline, self.opening.lock()).await.map_err(|_| timed_out(target))?;
        if let Some(client) = self.open() {
            return Ok(client);
        }
        let client = Arc::new(LaneConnection(Some(checkout(target, deadline).await?)));
        *self.current.lock().expect("lane lock") = Some(client.clone());
        Ok(client)
    }

    /// The current connection, unless the server closed it.
    fn open(&self) -> Option<Arc<LaneConnection>> {
        self.current.lock().expect("lane lock").as_ref().filter(|c| !c.is_closed()).cloned()
    }

    /// Writes no further batch on `client`: the server closed it, or a statement on it had no
    /// answer in time. The batches already on it end with it.
    fn give_up(&self, client: &Arc<LaneConnection>) {
        let mut current = self.current.lock().expect("lane lock");
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
            *current = None;
        }
    }
}

/// A pooled connection, waited for until `deadline`. The pool does not test a connection at
/// checkout: an empty query would cost each batch a round trip and a "transaction", and the
/// batch's own statement tests it as well (docs/performance.md, "No verification query per
/// checkout"). A connection the server closed is known closed and replaced by the pool. One the
/// network dropped without a word (no FIN, no RST: a NAT's or firewall's state lost, a server gone
/// in a failover) is noticed when a statement on it misses its deadline: the caller runs it
/// [`inbox_domain::db::within`] the deadline, which then abandons the connection (out of the pool,
/// its statement cancelled), so the next batch never waits behind it until TCP keepalive gives up.
async fn checkout(target: &Target, deadline: Instant) -> Result<Object, Cow<'static, str>> {
    match tokio::time::timeout_at(deadline, target.pool.get()).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(no_connection(&e)),
        Err(_) => Err(timed_out(target)),
    }
}

/// Why a batch was not stored in time.
fn timed_out(target: &Target) -> Cow<'static, str> {
    format!("timed out: no connection and commit within --db-timeout ({:?})", target.timeout).into()
}

/// A connection lost during the commit leaves the outcome unknown: 503, and the redelivery meets
/// `ON CONFLICT` and is answered as a duplicate. A refusal of the data itself is deterministic
/// (classes 22 and 23, and 54 — program limits such as the stack depth a deeply nested body
/// exhausts): retrying the batch as it is would fail the same way.
fn classify(target: &Target, e: tokio_postgres::Error) -> BatchError {
    match e.code() {
        Some(code) if *code == SqlState::QUERY_CANCELED => {
            BatchError::Unavailable(inbox_domain::db::describe_db_error(&e).into())
        }
        Some(code) if ["22", "23", "54"].contains(&&code.code()[..2]) => {
            let sqlstate = code.code().to_owned();
            let message = e.as_db_error().map(|db| db.message().to_owned()).unwrap_or_default();
            tracing::warn!(sqlstate, "rows refused by the database");
            let body = sqlstate.starts_with("22") || *code == SqlState::STATEMENT_TOO_COMPLEX;
            BatchError::Refused { sqlstate, message, body }
        }
        _ => failed(target, &e, "insert failed"),
    }
}

/// A failed database call: logged with the server's SQLSTATE and message (at error level, and
/// reported to `/readyz`, when it shows the settings are wrong: retrying will not help).
fn failed(target: &Target, e: &tokio_postgres::Error, what: &'static str) -> BatchError {
    let error = inbox_domain::db::describe_db_error(e);
    let sqlstate = e.code().map(|c| c.code());
    if let Some(fix) = inbox_domain::db::misconfiguration(e) {
        if target.readiness.misconfigured(fix) {
            tracing::error!(
                sqlstate,
                error,
                fix,
                "{what}: the database settings are wrong; /readyz now answers 503"
            );
        } else {
            tracing::error!(sqlstate, error, "{what}");
        }
    } else {
        target.outage.failed(what, &error);
    }
    BatchError::Unavailable(error.into())
}

/// No connection from the pool: the cause, for the request's log line.
fn no_connection(e: &deadpool_postgres::PoolError) -> Cow<'static, str> {
    format!("no database connection: {}", inbox_domain::db::describe_pool_error(e)).into()
}
