//! The executor: runs claimed events in one transaction (transaction 2), each event inside its
//! own savepoint so that one failing event does not poison the others, and returns an outcome
//! per event. It writes nothing on failure: the [`crate::completer`] does, in a new transaction.
//!
//! One transaction for a batch is what keeps commits per event far below one: the claim and the
//! process commit are shared by every event of the batch. The price is that events of a batch
//! run one after the other on one connection; `--concurrency` sets how many run at once overall.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use futures_util::FutureExt as _;
use inbox_domain::handlers::{describe_db_error, InboxEvent, Registry};
use inbox_domain::store::{self, Claimed, InboxKey};

/// What running one event came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The handler's effect and `processed_at` committed together.
    Processed,
    /// No handler for the type: `processed_at` set, no effect.
    Ignored,
    /// Another worker processed the row meanwhile (our lease had expired): nothing done.
    AlreadyProcessed,
    /// Rolled back; the message goes to `last_error`.
    Failed(String),
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Ignored => "ignored",
            Outcome::AlreadyProcessed => "already_processed",
            Outcome::Failed(_) => "failed",
        }
    }
}

/// Limits of the process transaction.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `statement_timeout` of each statement (handler statements included).
    pub statement_timeout: Duration,
    /// `lock_timeout`, below the statement timeout, for the row locks and the handlers' locks.
    pub lock_timeout: Duration,
    /// `idle_in_transaction_session_timeout`: a worker stalled mid-transaction loses its session
    /// (and its row locks) instead of blocking others.
    pub idle_timeout: Duration,
    /// Bound on the whole transaction, measured by the worker itself.
    pub deadline: Duration,
}

/// A pooled connection that is discarded unless explicitly marked clean: a task cancelled or
/// panicking mid-transaction never hands a connection with an open or aborted transaction back
/// to the pool.
pub struct Conn {
    object: Option<Object>,
    clean: bool,
}

impl Conn {
    pub async fn get(pool: &Pool) -> Result<Conn, String> {
        pool.get()
            .await
            .map(|object| Conn { object: Some(object), clean: false })
            .map_err(|e| inbox_domain::db::describe_pool_error(&e))
    }

    pub fn client(&mut self) -> &mut Object {
        self.object.as_mut().expect("connection present until drop")
    }

    /// Declares the connection outside any transaction: it goes back to the pool when dropped.
    pub fn set_clean(&mut self, clean: bool) {
        self.clean = clean;
    }

    /// Whether the connection will go back to the pool.
    pub fn is_clean(&self) -> bool {
        self.clean
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            if !self.clean {
                // Detach from the pool and close: the server rolls back whatever was open.
                drop(Object::take(object));
            }
        }
    }
}

fn millis(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

/// Runs one claimed event; see [`execute_batch`].
pub async fn execute(conn: &mut Conn, registry: &Registry, claimed: &Claimed, limits: &Limits) -> Outcome {
    execute_batch(conn, registry, std::slice::from_ref(claimed), limits)
        .await
        .pop()
        .expect("one outcome per event")
}

/// Runs `claimed` under `limits` in one transaction; returns one outcome per claimed row, in
/// order. Afterwards `conn` is marked clean only when its transaction ended by a COMMIT or
/// ROLLBACK the server acknowledged; after an error outside a savepoint, a timeout or a
/// cancellation it is discarded, never reused — and every event of the batch is `Failed`.
pub async fn execute_batch(
    conn: &mut Conn,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Vec<Outcome> {
    conn.set_clean(false);
    let all_failed = |message: String| claimed.iter().map(|_| Outcome::Failed(message.clone())).collect();
    match tokio::time::timeout(limits.deadline, run_transaction(conn, registry, claimed, limits)).await {
        Ok(Ok(outcomes)) => {
            conn.set_clean(true);
            outcomes
        }
        Ok(Err(e)) if e.is_closed() => all_failed(format!(
            "the database closed the connection mid-transaction (idle in transaction over the {} ms \
             idle_in_transaction_session_timeout, a restart, or a terminated backend): {}",
            limits.idle_timeout.as_millis(),
            describe_db_error(&e)
        )),
        Ok(Err(e)) => all_failed(describe_db_error(&e)),
        Err(_) => all_failed(format!("processing took longer than {:?}", limits.deadline)),
    }
}

/// Whether one pass of a batch finished or must be redone with a savepoint per event.
enum Pass {
    Done(Vec<Outcome>),
    /// An event failed in a pass without savepoints: everything was rolled back.
    NeedsSavepoints,
}

/// Runs a batch optimistically first — without savepoints, two round trips per event fewer —
/// and only when an event fails, rolls back and redoes the batch with a savepoint per event, so
/// that the failure is isolated. Failures are rare; the common path pays nothing for isolation.
async fn run_transaction(
    conn: &mut Conn,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Result<Vec<Outcome>, tokio_postgres::Error> {
    if let Pass::Done(outcomes) = run_pass(conn, registry, claimed, limits, false).await? {
        return Ok(outcomes);
    }
    match run_pass(conn, registry, claimed, limits, true).await? {
        Pass::Done(outcomes) => Ok(outcomes),
        Pass::NeedsSavepoints => unreachable!("a pass with savepoints isolates every failure"),
    }
}

async fn run_pass(
    conn: &mut Conn,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
    savepoints: bool,
) -> Result<Pass, tokio_postgres::Error> {
    let client = conn.client();
    let mut tx = client.transaction().await?;
    let limits_stmt = tx.prepare_cached(store::SET_LIMITS_SQL).await?;
    tx.execute(
        &limits_stmt,
        &[&millis(limits.statement_timeout), &millis(limits.lock_timeout), &millis(limits.idle_timeout)],
    )
    .await?;
    let (providers, endpoints, ids) = store::key_columns(claimed.iter().map(|c| &c.key));
    let lock = tx.prepare_cached(store::LOCK_FOR_PROCESSING_SQL).await?;
    let mut locked: HashMap<InboxKey, InboxEvent> = tx
        .query(&lock, &[&providers, &endpoints, &ids])
        .await?
        .into_iter()
        .map(|row| {
            let event = InboxEvent {
                provider: row.get(0),
                endpoint: row.get(1),
                event_id: row.get(2),
                event_type: row.get(3),
                payload: row.get(4),
            };
            let key = InboxKey {
                provider: event.provider.clone(),
                endpoint: event.endpoint.clone(),
                event_id: event.event_id.clone(),
            };
            (key, event)
        })
        .collect();

    let mut outcomes = Vec::with_capacity(claimed.len());
    for row in claimed {
        let Some(event) = locked.remove(&row.key) else {
            outcomes.push(Outcome::AlreadyProcessed);
            continue;
        };
        let Some(handler) = registry.get(&event.event_type) else {
            outcomes.push(Outcome::Ignored);
            continue;
        };
        if !savepoints {
            let failure = match AssertUnwindSafe(handler(&tx, &event)).catch_unwind().await {
                Ok(Ok(())) => {
                    outcomes.push(Outcome::Processed);
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(panic) => format!("handler panicked: {}", panic_message(&panic)),
            };
            tx.rollback().await?;
            if claimed.len() > 1 {
                return Ok(Pass::NeedsSavepoints);
            }
            // A batch of one needs no savepoint: its rollback isolated the failure already.
            return Ok(Pass::Done(vec![Outcome::Failed(failure)]));
        }
        let savepoint = tx.savepoint("event").await?;
        let result = AssertUnwindSafe(handler(&savepoint, &event)).catch_unwind().await;
        outcomes.push(match result {
            Ok(Ok(())) => {
                savepoint.commit().await?;
                Outcome::Processed
            }
            Ok(Err(e)) => {
                savepoint.rollback().await?;
                Outcome::Failed(e.to_string())
            }
            Err(panic) => {
                savepoint.rollback().await?;
                Outcome::Failed(format!("handler panicked: {}", panic_message(&panic)))
            }
        });
    }

    let done: Vec<&InboxKey> = claimed
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| matches!(o, Outcome::Processed | Outcome::Ignored))
        .map(|(c, _)| &c.key)
        .collect();
    if done.is_empty() {
        tx.rollback().await?;
    } else {
        let (providers, endpoints, ids) = store::key_columns(done.into_iter());
        let mark = tx.prepare_cached(store::MARK_PROCESSED_SQL).await?;
        tx.execute(&mark, &[&providers, &endpoints, &ids]).await?;
        tx.commit().await?;
    }
    Ok(Pass::Done(outcomes))
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
