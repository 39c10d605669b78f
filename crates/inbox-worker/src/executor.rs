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
use inbox_domain::handlers::{describe_db_error, BatchHandler, Handler, InboxEvent, Registry};
use inbox_domain::store::{self, Claimed, InboxKey};
use serde_json::value::RawValue;
use tokio_postgres::types::{Json, ToSql, Type};

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

/// Runs a batch optimistically first — without savepoints, every event's statements pipelined
/// on the connection — and only when an event fails, rolls back and redoes the batch one event
/// at a time with a savepoint each, so that the failure is isolated. Failures are rare; the
/// common path pays nothing for isolation.
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

/// What a pass does with one claimed row.
enum Step {
    /// Not returned by the lock query: processed by another worker meanwhile.
    Gone,
    /// No handler for its type: marked processed with no effect. Holds the row's ctid.
    Ignore(String),
    /// Its handler runs; then the row (at the ctid) is marked processed.
    Run(Handler, InboxEvent, String),
}

impl Step {
    /// The outcome when the step's transaction committed.
    fn outcome(&self) -> Outcome {
        match self {
            Step::Gone => Outcome::AlreadyProcessed,
            Step::Ignore(_) => Outcome::Ignored,
            Step::Run(..) => Outcome::Processed,
        }
    }

    /// Where the locked row is, unless another worker processed it.
    fn ctid(&self) -> Option<&str> {
        match self {
            Step::Gone => None,
            Step::Ignore(ctid) | Step::Run(_, _, ctid) => Some(ctid),
        }
    }
}

/// A row of the lock statements: its key, its event and its ctid.
fn locked_row(row: tokio_postgres::Row) -> (InboxKey, (InboxEvent, String)) {
    let payload: Json<Box<RawValue>> = row.get(4);
    let event = InboxEvent::new(row.get(0), row.get(1), row.get(2), row.get(3), payload.0);
    let key = InboxKey {
        provider: event.provider.clone(),
        endpoint: event.endpoint.clone(),
        event_id: event.event_id.clone(),
    };
    (key, (event, row.get(5)))
}

/// What the optimistic pass runs, in the order of the batch: one event with its handler, or every
/// event of a type that has a set-based handler (two or more of them), at its first event's place.
enum Unit<'e> {
    One(Handler, &'e InboxEvent),
    Set(BatchHandler, Vec<&'e InboxEvent>),
}

fn units<'e>(registry: &Registry, steps: &'e [Step]) -> Vec<Unit<'e>> {
    let mut units = Vec::new();
    // Per type with a set-based handler: its unit's index, and the per-event handler.
    let mut sets: HashMap<&str, (usize, Handler)> = HashMap::new();
    for step in steps {
        let Step::Run(handler, event, _) = step else { continue };
        let Some(batch) = registry.get_batch(&event.event_type) else {
            units.push(Unit::One(*handler, event));
            continue;
        };
        match sets.get(event.event_type.as_str()) {
            Some(&(i, _)) => {
                if let Unit::Set(_, events) = &mut units[i] {
                    events.push(event);
                }
            }
            None => {
                sets.insert(&event.event_type, (units.len(), *handler));
                units.push(Unit::Set(batch, vec![event]));
            }
        }
    }
    // A set of one runs the per-event handler.
    for (i, handler) in sets.into_values() {
        if let Unit::Set(_, events) = &units[i] {
            if let [event] = events[..] {
                units[i] = Unit::One(handler, event);
            }
        }
    }
    units
}

/// One pass over the batch in a new transaction. Round trips on the optimistic path (no
/// savepoints): BEGIN; the limits and the row locks (pipelined); every handler's statements and
/// the processed mark (pipelined: tokio-postgres sends requests polled together in one write, and
/// the server runs them in order); COMMIT. Events of a type with a set-based handler run as one
/// set (one statement for `invoice.paid`). A handler needing a second statement (a rare branch)
/// adds a round trip for the batch, not per event. The savepoint pass runs the per-event
/// handlers, one event at a time.
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
    let (statement_timeout, lock_timeout, idle_timeout) =
        (millis(limits.statement_timeout), millis(limits.lock_timeout), millis(limits.idle_timeout));
    let claimed_ctids: Vec<&str> = claimed.iter().map(|c| c.ctid.as_str()).collect();
    let limits_params: [&(dyn ToSql + Sync); 3] = [&statement_timeout, &lock_timeout, &idle_timeout];
    // Unnamed: planned for these rows every time (see the store module's "Plans").
    let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&claimed_ctids, Type::TEXT_ARRAY)];
    let (_, rows) = tokio::try_join!(
        tx.execute(&limits_stmt, &limits_params),
        tx.query_typed(store::LOCK_BY_CTID_SQL, &lock_params)
    )?;
    // Each locked row: its event and its ctid (for the processed mark).
    let mut locked: HashMap<InboxKey, (InboxEvent, String)> = rows.into_iter().map(locked_row).collect();
    // Rows that moved since their claim (a lease expired meanwhile): look for them by key.
    let moved: Vec<&Claimed> = claimed.iter().filter(|c| !locked.contains_key(&c.key)).collect();
    if !moved.is_empty() {
        let (providers, endpoints, ids) = store::key_columns(moved.iter().map(|c| &c.key));
        let params: [(&(dyn ToSql + Sync), Type); 3] =
            [(&providers, Type::TEXT_ARRAY), (&endpoints, Type::TEXT_ARRAY), (&ids, Type::TEXT_ARRAY)];
        locked.extend(tx.query_typed(store::LOCK_BY_KEY_SQL, &params).await?.into_iter().map(locked_row));
    }
    let steps: Vec<Step> = claimed
        .iter()
        .map(|row| match locked.remove(&row.key) {
            None => Step::Gone,
            Some((event, ctid)) => match registry.get(&event.event_type) {
                None => Step::Ignore(ctid),
                Some(handler) => Step::Run(handler, event, ctid),
            },
        })
        .collect();
    if !savepoints {
        let units = units(registry, &steps);
        let runs = units.iter().map(|unit| {
            let run = match unit {
                Unit::One(handler, event) => handler(&tx, event),
                Unit::Set(handler, events) => handler(&tx, events),
            };
            AssertUnwindSafe(run).catch_unwind()
        });
        let done: Vec<&str> = steps.iter().filter_map(Step::ctid).collect();
        let mark_all = async {
            if done.is_empty() {
                return Ok(0);
            }
            store::mark_processed(&tx, &done).await
        };
        // Handlers first: their first statements are queued before the mark.
        let (results, marked) = tokio::join!(futures_util::future::join_all(runs), mark_all);
        let failure = results.into_iter().find_map(|result| match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(panic) => Some(format!("handler panicked: {}", panic_message(&panic))),
        });
        let Some(failure) = failure else {
            marked?;
            if done.is_empty() {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
            }
            return Ok(Pass::Done(steps.iter().map(Step::outcome).collect()));
        };
        tx.rollback().await?;
        if claimed.len() > 1 {
            return Ok(Pass::NeedsSavepoints);
        }
        // A batch of one needs no savepoint: its rollback isolated the failure already.
        return Ok(Pass::Done(vec![Outcome::Failed(failure)]));
    }

    let mut outcomes = Vec::with_capacity(claimed.len());
    for step in &steps {
        let Step::Run(handler, event, _) = step else {
            outcomes.push(step.outcome());
            continue;
        };
        let savepoint = tx.savepoint("event").await?;
        let result = AssertUnwindSafe(handler(&savepoint, event)).catch_unwind().await;
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
    let done: Vec<&str> = steps
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| matches!(o, Outcome::Processed | Outcome::Ignored))
        .filter_map(|(step, _)| step.ctid())
        .collect();
    if done.is_empty() {
        tx.rollback().await?;
    } else {
        store::mark_processed(&tx, &done).await?;
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
