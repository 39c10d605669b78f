//! The executor: runs a claimed batch in one process transaction (transaction 2) and returns an
//! outcome per event. It writes nothing on failure: the [`crate::completer`] does, in a new
//! transaction.
//!
//! A batch first runs *pipelined*, without savepoints: the limits and the row locks in one write,
//! then every handler's statements and the processed mark in another, then COMMIT. Only when an
//! event fails does the batch run again *isolated*, in a new transaction with a savepoint per
//! event, so that the failure stays with its own event and the others commit. Failures are rare;
//! the common path pays nothing for isolation.
//!
//! One transaction for a batch is what keeps commits per event far below one: the claim and the
//! process commit are shared by every event of the batch. The events of a batch share one
//! connection; `--concurrency` / `--batch-size` batches run at once.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use deadpool_postgres::{Object, Transaction};
use futures_util::FutureExt as _;
use inbox_domain::db::{describe_db_error, Pooler};
use inbox_domain::handler::{BatchHandler, Handler, HandlerError, Registry};
use inbox_domain::inbox::event::InboxEvent;
use inbox_domain::inbox::store::queue::{self, Claimed};
use inbox_domain::inbox::store::{set_limits, InboxKey, TransactionLimits};

use crate::conn::Conn;

/// What running one event came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The handler's effect and `processed_at` committed together.
    Processed,
    /// No handler for the type: `processed_at` set, no effect.
    Ignored,
    /// Another worker processed the row meanwhile (our lease had expired): nothing done.
    AlreadyProcessed,
    /// Rolled back; the message goes to `last_error`, and the attempt counts toward the limit.
    Failed(String),
    /// Rolled back by an infrastructure fault that is not the event's doing — the connection
    /// lost mid-transaction (a restart, a terminated backend, a network cut), a lock or resource
    /// the batch could not get in time: the attempt is given back (see
    /// `completer::return_interrupted`), so an outage never parks healthy events.
    Interrupted(String),
}

/// How the process transaction runs: its limits, and what may outlive it.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Behind a transaction pooler, the statements handlers prepared (`prepare_cached`) are closed
    /// before the transaction ends, so none is left on a server connection that another
    /// transaction — ours or another client's — gets next.
    pub pooler: Pooler,
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

impl Limits {
    /// The part the server enforces.
    fn transaction(&self) -> TransactionLimits {
        TransactionLimits {
            statement_timeout: self.statement_timeout,
            lock_timeout: self.lock_timeout,
            idle_timeout: self.idle_timeout,
        }
    }
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
/// cancellation it is discarded, never reused — and every event of the batch is `Interrupted`
/// when the error is an infrastructure fault ([`is_infrastructure_fault`]), else `Failed`.
pub async fn execute_batch(
    conn: &mut Conn,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Vec<Outcome> {
    conn.set_clean(false);
    let all_failed = |message: String| claimed.iter().map(|_| Outcome::Failed(message.clone())).collect();
    let all_interrupted =
        |message: String| claimed.iter().map(|_| Outcome::Interrupted(message.clone())).collect();
    let run = async {
        match run_pipelined(conn.client(), registry, claimed, limits).await? {
            Pipelined::Done(outcomes) => Ok(outcomes),
            // A batch of one needs no second pass: its rollback isolated the failure already.
            Pipelined::Failed(message) if claimed.len() == 1 => Ok(vec![Outcome::Failed(message)]),
            Pipelined::Failed(_) => run_isolated(conn.client(), registry, claimed, limits).await,
        }
    };
    match tokio::time::timeout(limits.deadline, run).await {
        Ok(Ok(outcomes)) => {
            conn.set_clean(true);
            outcomes
        }
        Ok(Err(e)) if e.is_closed() => all_interrupted(format!(
            "interrupted, attempt not counted: the database closed the connection mid-transaction \
             (idle in transaction over the {} ms idle_in_transaction_session_timeout, a restart, or a \
             terminated backend): {}",
            limits.idle_timeout.as_millis(),
            describe_db_error(&e)
        )),
        Ok(Err(e)) if is_infrastructure_fault(&e) => {
            all_interrupted(format!("interrupted, attempt not counted: {}", describe_db_error(&e)))
        }
        Ok(Err(e)) => all_failed(describe_db_error(&e)),
        // Counted: a batch over the worker's deadline is most often its handlers' doing (many
        // slow statements); a server too stalled to answer for that long is rarer than a poison.
        Err(_) => all_failed(format!("processing took longer than {:?}", limits.deadline)),
    }
}

/// Whether a batch-level error (outside any handler's savepoint) is the infrastructure's doing
/// rather than the events': the connection or the server going away (class 08, 57P01..57P03), a
/// lock the batch could not get within `lock_timeout` (55P03: another session holds its rows),
/// a serialization failure or deadlock (40001, 40P01: retrying succeeds), a server out of
/// resources (class 53), or settings wrong for what is in between (a prepared statement gone
/// between transactions: `inbox_domain::db::misconfiguration`). Anything else — a constraint a handler's deferred write broke at COMMIT,
/// a statement timeout — is counted: it may be the events', and counting is what parks a poison.
pub fn is_infrastructure_fault(e: &tokio_postgres::Error) -> bool {
    if inbox_domain::db::misconfiguration(e).is_some() {
        return true;
    }
    let Some(code) = e.code() else { return e.is_closed() };
    let code = code.code();
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(code, "57P01" | "57P02" | "57P03" | "55P03" | "40001" | "40P01")
}

/// What a transaction does with one claimed row.
// One Vec of these per batch, built once: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
enum Step<'r> {
    /// Not returned by the lock statements: processed by another worker meanwhile.
    Gone,
    /// Its type is ignored (`Registry::ignore`): marked processed with no effect.
    Ignore { ctid: String },
    /// Neither handled nor ignored (the claim never takes such a row): not touched here.
    NotOurs,
    /// Its handler runs; then the row is marked processed.
    Run { handler: &'r dyn Handler, event: InboxEvent, ctid: String },
}

impl Step<'_> {
    /// The outcome when the step's transaction committed.
    fn outcome(&self) -> Outcome {
        match self {
            Step::Gone => Outcome::AlreadyProcessed,
            Step::Ignore { .. } => Outcome::Ignored,
            // Given back with its attempt, never marked done here.
            Step::NotOurs => Outcome::Interrupted(
                "handed back: this worker neither handles nor ignores the event's type".to_owned(),
            ),
            Step::Run { .. } => Outcome::Processed,
        }
    }

    /// Where the locked row is, unless another worker processed it.
    fn ctid(&self) -> Option<&str> {
        match self {
            Step::Gone | Step::NotOurs => None,
            Step::Ignore { ctid } | Step::Run { ctid, .. } => Some(ctid),
        }
    }
}

/// Begins a process transaction: its limits and the claimed rows' locks (one write), then the
/// lookup by key of rows that moved since their claim (a lease expired meanwhile). Returns the
/// transaction and a step per claimed row, in order.
async fn begin<'c, 'r>(
    client: &'c mut Object,
    registry: &'r Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Result<(Transaction<'c>, Vec<Step<'r>>), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let tx_limits = limits.transaction();
    let (_, rows) = tokio::try_join!(set_limits(&tx, &tx_limits), queue::lock_by_ctid(&tx, claimed))?;
    let mut locked: HashMap<InboxKey, queue::LockedRow> =
        rows.into_iter().map(|row| (row.key(), row)).collect();
    let moved: Vec<&Claimed> = claimed.iter().filter(|c| !locked.contains_key(&c.key)).collect();
    if !moved.is_empty() {
        locked.extend(queue::lock_by_key(&tx, &moved).await?.into_iter().map(|row| (row.key(), row)));
    }
    let steps = claimed
        .iter()
        .map(|c| match locked.remove(&c.key) {
            None => Step::Gone,
            Some(row) => match registry.get(&row.event.event_type) {
                Some(handler) => Step::Run { handler, event: row.event, ctid: row.ctid },
                None if registry.ignores(&row.event.event_type) => Step::Ignore { ctid: row.ctid },
                // The claim takes only what the registry handles or ignores: a row of another type
                // is not this worker's to mark done. Left as it is, for a worker that handles it.
                None => Step::NotOurs,
            },
        })
        .collect();
    Ok((tx, steps))
}

/// Ends a transaction that changed rows with COMMIT, one that changed nothing with ROLLBACK
/// (behind a transaction pooler, after closing the statements it prepared: see
/// [`Limits::pooler`]).
async fn finish(tx: Transaction<'_>, changed: bool, pooler: Pooler) -> Result<(), tokio_postgres::Error> {
    forget_statements(&tx, pooler);
    if changed {
        tx.commit().await
    } else {
        tx.rollback().await
    }
}

/// Behind a transaction pooler: drops the statements prepared in this transaction, which sends
/// their Close ahead of whatever this transaction sends next (COMMIT or ROLLBACK), on the server
/// connection that prepared them.
fn forget_statements(tx: &Transaction<'_>, pooler: Pooler) {
    if pooler == Pooler::Transaction {
        tx.statement_cache.clear();
    }
}

/// How the pipelined pass ended.
enum Pipelined {
    /// Committed (or nothing to commit).
    Done(Vec<Outcome>),
    /// An event failed: everything was rolled back. The message is the first failure's.
    Failed(String),
}

/// What the pipelined pass runs, in the order of the batch: one event with its handler, or every
/// event of a type that has a set-based handler (two or more of them), at its first event's place.
enum Unit<'s, 'r> {
    One(&'r dyn Handler, &'s InboxEvent),
    Set(&'r dyn BatchHandler, Vec<&'s InboxEvent>),
}

fn units<'s, 'r>(registry: &'r Registry, steps: &'s [Step<'r>]) -> Vec<Unit<'s, 'r>> {
    let mut units = Vec::new();
    // Per type with a set-based handler: its unit's index, and the per-event handler.
    let mut sets: HashMap<&str, (usize, &'r dyn Handler)> = HashMap::new();
    for step in steps {
        let Step::Run { handler, event, .. } = step else { continue };
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

/// The pipelined pass. Round trips: BEGIN; the limits and the row locks (one write); every
/// handler's statements and the processed mark (one write: tokio-postgres sends requests polled
/// together in one write, and the server runs them in order); COMMIT. Events of a type with a
/// set-based handler run as one set (one statement for `invoice.paid`). A handler needing a second
/// statement (a rare branch) adds a round trip for the batch, not per event.
async fn run_pipelined(
    client: &mut Object,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Result<Pipelined, tokio_postgres::Error> {
    let (tx, steps) = begin(client, registry, claimed, limits).await?;
    let units = units(registry, &steps);
    let runs = units.iter().map(|unit| {
        let run = match unit {
            Unit::One(handler, event) => handler.handle(&tx, event),
            Unit::Set(handler, events) => handler.handle_batch(&tx, events),
        };
        AssertUnwindSafe(run).catch_unwind()
    });
    let done: Vec<&str> = steps.iter().filter_map(Step::ctid).collect();
    let mark = async {
        if done.is_empty() {
            return Ok(0);
        }
        queue::mark_processed(&tx, &done).await
    };
    // Handlers first: their first statements are queued before the mark.
    let (results, marked) = tokio::join!(futures_util::future::join_all(runs), mark);
    if let Some(failure) = results.into_iter().find_map(failure_message) {
        forget_statements(&tx, limits.pooler);
        tx.rollback().await?;
        return Ok(Pipelined::Failed(failure));
    }
    marked?;
    finish(tx, !done.is_empty(), limits.pooler).await?;
    Ok(Pipelined::Done(steps.iter().map(Step::outcome).collect()))
}

/// The isolated pass: the per-event handlers one event at a time, each in a savepoint, so a
/// failing event rolls back alone; the others and their marks commit.
async fn run_isolated(
    client: &mut Object,
    registry: &Registry,
    claimed: &[Claimed],
    limits: &Limits,
) -> Result<Vec<Outcome>, tokio_postgres::Error> {
    let (mut tx, steps) = begin(client, registry, claimed, limits).await?;
    let mut outcomes = Vec::with_capacity(steps.len());
    for step in &steps {
        let Step::Run { handler, event, .. } = step else {
            outcomes.push(step.outcome());
            continue;
        };
        let savepoint = tx.savepoint("event").await?;
        let result = AssertUnwindSafe(handler.handle(&savepoint, event)).catch_unwind().await;
        outcomes.push(match failure_message(result) {
            None => {
                savepoint.commit().await?;
                Outcome::Processed
            }
            Some(message) => {
                savepoint.rollback().await?;
                Outcome::Failed(message)
            }
        });
    }
    let done: Vec<&str> = steps
        .iter()
        .zip(&outcomes)
        .filter(|(_, outcome)| matches!(outcome, Outcome::Processed | Outcome::Ignored))
        .filter_map(|(step, _)| step.ctid())
        .collect();
    if !done.is_empty() {
        queue::mark_processed(&tx, &done).await?;
    }
    finish(tx, !done.is_empty(), limits.pooler).await?;
    Ok(outcomes)
}

/// The message of a handler's failure or panic; None when it succeeded.
fn failure_message(result: std::thread::Result<Result<(), HandlerError>>) -> Option<String> {
    match result {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(panic) => Some(format!(
            "handler panicked: {}",
            panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".to_owned())
        )),
    }
}
