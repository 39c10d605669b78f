//! The executor: runs one claimed event in its own transaction (transaction 2) and returns what
//! happened. It writes nothing on failure: the [`crate::completer`] does, in a new transaction.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use futures_util::FutureExt as _;
use inbox_domain::handlers::{describe_db_error, InboxEvent, Registry};
use inbox_domain::store::{self, Claimed};

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
    /// `lock_timeout`, below the statement timeout, for the row lock and the handler's locks.
    pub lock_timeout: Duration,
    /// `idle_in_transaction_session_timeout`: a worker stalled mid-transaction loses its session
    /// (and the row lock) instead of blocking others.
    pub idle_timeout: Duration,
    /// Bound on the whole transaction, measured by the worker itself.
    pub deadline: Duration,
}

/// A pooled connection that is discarded unless explicitly released in a known-clean state:
/// a task cancelled or panicking mid-transaction never hands a connection with an open or
/// aborted transaction back to the pool.
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

/// Runs `claimed` under `limits`. Afterwards `conn` is marked clean only when its transaction
/// ended by an explicit COMMIT or ROLLBACK that the server acknowledged; after an error midway,
/// a timeout or a cancellation it is discarded, never reused.
pub async fn execute(conn: &mut Conn, registry: &Registry, claimed: &Claimed, limits: &Limits) -> Outcome {
    conn.set_clean(false);
    match tokio::time::timeout(limits.deadline, run_transaction(conn, registry, claimed, limits)).await {
        Ok(Ok(outcome)) => {
            conn.set_clean(true);
            outcome
        }
        Ok(Err(e)) if e.is_closed() => Outcome::Failed(format!(
            "the database closed the connection mid-transaction (idle in transaction over the {} ms \
             idle_in_transaction_session_timeout, a restart, or a terminated backend): {}",
            limits.idle_timeout.as_millis(),
            describe_db_error(&e)
        )),
        Ok(Err(e)) => Outcome::Failed(describe_db_error(&e)),
        Err(_) => Outcome::Failed(format!("processing took longer than {:?}", limits.deadline)),
    }
}

async fn run_transaction(
    conn: &mut Conn,
    registry: &Registry,
    claimed: &Claimed,
    limits: &Limits,
) -> Result<Outcome, tokio_postgres::Error> {
    let key = &claimed.key;
    let client = conn.client();
    let tx = client.transaction().await?;
    let limits_stmt = tx.prepare_cached(store::SET_LIMITS_SQL).await?;
    tx.execute(
        &limits_stmt,
        &[&millis(limits.statement_timeout), &millis(limits.lock_timeout), &millis(limits.idle_timeout)],
    )
    .await?;
    let lock = tx.prepare_cached(store::LOCK_FOR_PROCESSING_SQL).await?;
    let Some(row) = tx.query_opt(&lock, &[&key.provider, &key.endpoint, &key.event_id]).await? else {
        tx.rollback().await?;
        return Ok(Outcome::AlreadyProcessed);
    };
    let event = InboxEvent {
        provider: key.provider.clone(),
        endpoint: key.endpoint.clone(),
        event_id: key.event_id.clone(),
        event_type: row.get(0),
        payload: row.get(1),
    };
    let outcome = match registry.get(&event.event_type) {
        None => Outcome::Ignored,
        Some(handler) => match AssertUnwindSafe(handler(&tx, &event)).catch_unwind().await {
            Ok(Ok(())) => Outcome::Processed,
            Ok(Err(e)) => {
                tx.rollback().await?;
                return Ok(Outcome::Failed(e.to_string()));
            }
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".to_owned());
                tx.rollback().await?;
                return Ok(Outcome::Failed(format!("handler panicked: {message}")));
            }
        },
    };
    let mark = tx.prepare_cached(store::MARK_PROCESSED_SQL).await?;
    tx.execute(&mark, &[&key.provider, &key.endpoint, &key.event_id]).await?;
    tx.commit().await?;
    Ok(outcome)
}
