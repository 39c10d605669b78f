//! Group commit: concurrent webhook requests coalesced into one multi-row
//! `INSERT … ON CONFLICT DO NOTHING RETURNING`, each answered only after that commit.
//!
//! Batching is "natural": a writer takes whatever requests are queued when it becomes free, so a
//! lone request is written at once (no timer) and under load the batches grow while the previous
//! commits are in flight. Up to `writers` batches are in flight at once (each holds one pooled
//! connection), but a batch only starts beside another one once [`JOIN_AT`] requests wait for it:
//! a commit of five rows costs PostgreSQL nearly what one of thirty does, so at moderate rates one
//! writer at a time takes everything that arrived during the previous commit, and the others
//! join as the queue grows. A failed batch answers 503 to each of its requests; a batch refused
//! for its data (class 22, e.g. a `\u0000` that `jsonb` rejects) is retried one row at a time so
//! only the offending request gets its 400.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::web::Bytes;
use deadpool_postgres::Pool;
use inbox_domain::budget::{ByteBudget, BytesHeld};
use inbox_domain::db::Pooler;
use inbox_domain::inbox::store::ingest::{self as store, InsertOutcome, NewEvent};
use inbox_domain::PROVIDER_STRIPE;
use tokio::sync::{mpsc, oneshot, Mutex, Notify};
use tokio_postgres::error::SqlState;

use crate::error::IngestError;
use crate::metrics::Metrics;

/// A verified event waiting for its batch.
struct Pending {
    endpoint: String,
    event_id: String,
    event_type: String,
    payload: Bytes,
    reply: oneshot::Sender<Result<InsertOutcome, IngestError>>,
    /// The payload's share of the bytes in flight, given back when the batch is written — not
    /// when the request gives up waiting: the payload stays queued until then.
    _held: BytesHeld,
}

/// The most requests written by one statement.
pub const MAX_BATCH: usize = 256;

/// Requests that must be waiting before a batch starts while another one is being written.
pub const JOIN_AT: usize = 8;

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
    /// Payload bytes queued or being written: a slow database makes requests wait here (and
    /// then 503) instead of making the process grow.
    payloads: ByteBudget,
}

impl Batcher {
    /// Starts `writers` writer tasks on the current runtime. They stop when every handle is dropped.
    pub fn start(
        pool: Pool,
        pooler: Pooler,
        writers: usize,
        db_timeout: Duration,
        payloads: ByteBudget,
        metrics: Metrics,
    ) -> Batcher {
        let target = Target { pool, pooler, timeout: db_timeout };
        let (queue, rx) = mpsc::channel(MAX_BATCH * writers.max(1) * 4);
        let shared =
            Arc::new(Writers { queue: Mutex::new(rx), writing: AtomicUsize::new(0), changed: Notify::new() });
        for _ in 0..writers.max(1) {
            tokio::spawn(writer(shared.clone(), target.clone(), metrics.clone()));
        }
        Batcher { queue, writers: shared, payloads }
    }

    /// Stores one event; resolves once its batch committed (or failed). Waits first for the
    /// payload's room in the bytes in flight.
    pub async fn insert(
        &self,
        endpoint: &str,
        event_id: &str,
        event_type: &str,
        payload: Bytes,
    ) -> Result<InsertOutcome, IngestError> {
        let held = self.payloads.take(payload.len() as u64).await;
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            endpoint: endpoint.to_owned(),
            event_id: event_id.to_owned(),
            event_type: event_type.to_owned(),
            payload,
            reply,
            _held: held,
        };
        self.queue.send(pending).await.map_err(|_| IngestError::Unavailable("shutting down"))?;
        if self.queue.max_capacity() - self.queue.capacity() >= JOIN_AT - 1 {
            // With the one a waiting writer already holds, enough for a batch beside the others.
            self.writers.changed.notify_one();
        }
        answer.await.map_err(|_| IngestError::Unavailable("writer stopped"))?
    }
}

/// Where and how batches are written.
#[derive(Clone)]
struct Target {
    pool: Pool,
    pooler: Pooler,
    /// Bound on a connection plus the insert, and the insert's server-side statement timeout.
    timeout: Duration,
}

async fn writer(shared: Arc<Writers>, target: Target, metrics: Metrics) {
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
        write(&target, batch).await;
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
async fn write(target: &Target, batch: Vec<Pending>) {
    // One row per key: the first request of a key decides, the others are its duplicates.
    let mut first_of: HashMap<(&str, &str), usize> = HashMap::new();
    let mut rows = Vec::with_capacity(batch.len());
    for (i, p) in batch.iter().enumerate() {
        if *first_of.entry((p.endpoint.as_str(), p.event_id.as_str())).or_insert(i) == i {
            rows.push(NewEvent {
                endpoint: &p.endpoint,
                event_id: &p.event_id,
                event_type: &p.event_type,
                payload: &p.payload,
            });
        }
    }
    let result = insert(target, &rows).await;
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
        Err(BatchError::Data) if rows.len() > 1 => {
            // One bad payload must not fail its neighbours: retry each row on its own.
            let mut answers = Vec::with_capacity(batch.len());
            for (i, p) in batch.iter().enumerate() {
                let first = first_of[&(p.endpoint.as_str(), p.event_id.as_str())] == i;
                let row = NewEvent {
                    endpoint: &p.endpoint,
                    event_id: &p.event_id,
                    event_type: &p.event_type,
                    payload: &p.payload,
                };
                answers.push(match insert(target, std::slice::from_ref(&row)).await {
                    Ok(inserted) if first && !inserted.is_empty() => Ok(InsertOutcome::Accepted),
                    Ok(_) => Ok(InsertOutcome::Duplicate),
                    Err(e) => Err(e.into()),
                });
            }
            answers
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

#[derive(Debug, Clone, Copy)]
enum BatchError {
    /// PostgreSQL refused the data (class 22): the same rows fail on every retry.
    Data,
    /// Anything else: a retry may pass.
    Unavailable(&'static str),
}

impl From<BatchError> for IngestError {
    fn from(e: BatchError) -> Self {
        match e {
            BatchError::Data => IngestError::PayloadRefused,
            BatchError::Unavailable(cause) => IngestError::Unavailable(cause),
        }
    }
}

async fn insert(target: &Target, rows: &[NewEvent<'_>]) -> Result<HashSet<(String, String)>, BatchError> {
    let work = async {
        let client = target.pool.get().await.map_err(|e| {
            tracing::debug!(error = %inbox_domain::db::describe_pool_error(&e), "no database connection");
            BatchError::Unavailable("no connection")
        })?;
        store::insert_events(&client, target.pooler, PROVIDER_STRIPE, rows, target.timeout)
            .await
            .map_err(classify)
    };
    match tokio::time::timeout(target.timeout, work).await {
        Ok(Ok(inserted)) => Ok(inserted.into_iter().collect()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(BatchError::Unavailable("timed out")),
    }
}

/// A connection lost during the commit leaves the outcome unknown: 503, and the redelivery meets
/// `ON CONFLICT` and is answered as a duplicate.
fn classify(e: tokio_postgres::Error) -> BatchError {
    match e.code() {
        Some(code) if code.code().starts_with("22") => {
            tracing::warn!(sqlstate = code.code(), "payload refused by the database");
            BatchError::Data
        }
        Some(code) if *code == SqlState::QUERY_CANCELED => BatchError::Unavailable("statement timeout"),
        _ => {
            tracing::warn!(error = %inbox_domain::db::describe_db_error(&e), "insert failed");
            BatchError::Unavailable("database error")
        }
    }
}
