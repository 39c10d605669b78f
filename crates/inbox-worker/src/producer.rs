//! The producer: claims ready rows (transaction 1) as capacity frees up, and hands each to an
//! executor task. It stops claiming the moment shutdown starts.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use inbox_domain::budget::ByteBudget;
use inbox_domain::db::{describe_db_error, OutageLog};
use inbox_domain::handler::{ClaimFilter, Registry};
use inbox_domain::inbox::store::queue::{self, Claim, Claimed, Failure};
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::completer::{self, FailureRecord};
use crate::conn::Conn;
use crate::executor::{self, Limits, Outcome};
use crate::metrics::{EventOutcome, Metrics};

/// What every event task shares.
pub struct Context {
    pub pool: Pool,
    pub registry: Registry,
    /// What the claims take: the types `registry` handles or ignores (its `claim_filter`).
    pub claims: ClaimFilter,
    pub limits: Limits,
    pub max_attempts: i32,
    pub lease: Duration,
    /// Bound on each claim, failure record and hand-back. The pool does not verify connections
    /// at checkout, so a connection the network dropped silently fails by this deadline (and is
    /// discarded) instead of hanging the producer. The claim's server-side statement timeout is
    /// half of it, so the server gives up on a slow claim before the worker stops waiting for it.
    pub db_timeout: Duration,
    pub metrics: Metrics,
    /// Cancelled at the first stop signal: no new claims, unstarted rows are handed back.
    pub shutdown: CancellationToken,
    /// One line when the claims start failing, one when they succeed again.
    pub outage: OutageLog,
}

/// How much a worker takes on at once. A claim waits until all three have room.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    /// Events in flight (`--concurrency`).
    pub events: usize,
    /// Rows per claim and per process transaction (`--batch-size`, at most `events`).
    pub batch_size: usize,
    /// Process transactions in flight, each on its own connection: `events / batch_size`,
    /// rounded up. Without this bound, rows arriving one at a time would make one transaction
    /// (and one connection) per event.
    pub transactions: usize,
    /// Payload bytes in flight (`--max-bytes-in-flight`): what bounds the worker's memory whatever
    /// the size of the events. A claim may go over by one row (it always takes at least one).
    pub bytes: u64,
}

impl Capacity {
    pub fn new(events: usize, batch_size: usize, bytes: u64) -> Self {
        let batch_size = batch_size.clamp(1, events.max(1));
        Capacity { events, batch_size, transactions: events.div_ceil(batch_size), bytes }
    }
}

/// Claims and dispatches until shutdown; returns the tasks still in flight.
pub async fn run(
    ctx: Arc<Context>,
    capacity: Capacity,
    poll_interval: Duration,
    wake: Arc<Notify>,
) -> JoinSet<()> {
    let events = Arc::new(Semaphore::new(capacity.events));
    let transactions = Arc::new(Semaphore::new(capacity.transactions));
    let payloads = ByteBudget::new(capacity.bytes);
    let mut tasks = JoinSet::new();
    let mut retry_delay = poll_interval.min(Duration::from_millis(500));
    loop {
        while let Some(done) = tasks.try_join_next() {
            report_task_end(done);
        }
        if ctx.shutdown.is_cancelled() {
            break;
        }
        let (free_events, free_bytes) = (events.available_permits(), payloads.available());
        if free_events == 0 || free_bytes == 0 || transactions.available_permits() == 0 {
            // Every task returns its capacity when it ends.
            tokio::select! {
                _ = ctx.shutdown.cancelled() => break,
                Some(done) = tasks.join_next() => report_task_end(done),
            }
            continue;
        }
        let want = free_events.min(capacity.batch_size);
        let budget = i64::try_from(free_bytes).unwrap_or(i64::MAX);
        let (claimed, parked) = match claim(&ctx, want, budget).await {
            Ok(claim) => {
                ctx.outage.succeeded();
                retry_delay = poll_interval.min(Duration::from_millis(500));
                report_parked(&ctx, &claim.parked);
                (claim.claimed, claim.parked.len())
            }
            Err(e) => {
                if e.contains(inbox_domain::db::POOLER_FIX) {
                    tracing::error!(error = %e, "claim failed: the database settings are wrong; retrying");
                } else {
                    ctx.outage.failed("claiming (retried with backoff)", &e);
                }
                tokio::select! {
                    _ = ctx.shutdown.cancelled() => break,
                    _ = tokio::time::sleep(retry_delay) => {}
                }
                retry_delay = (retry_delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        ctx.metrics.claim_batch_size.observe(claimed.len() as f64);
        // Rows the claim parked took places of its limit too: then more may be ready as well.
        let full = claimed.len() + parked == want;
        if !claimed.is_empty() {
            let bytes: u64 = claimed.iter().map(|c| c.bytes.max(0) as u64).sum();
            // The claim stopped at the free budget but for its last row: charge what is free at most.
            let k = payloads.take_available(bytes);
            let permits = (
                events.clone().try_acquire_many_owned(claimed.len() as u32),
                transactions.clone().try_acquire_owned(),
            );
            let (Ok(e), Ok(t)) = permits else {
                unreachable!("only this loop takes capacity, and it claimed within what was free")
            };
            let ctx = ctx.clone();
            tasks.spawn(async move {
                process_batch(&ctx, claimed).await;
                drop((e, t, k));
            });
        }
        if full {
            continue; // More may be ready: claim again as soon as there is room.
        }
        tokio::select! {
            _ = ctx.shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(poll_interval) => {}
        }
    }
    tasks
}

fn report_task_end(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "event task ended abnormally");
    }
}

async fn claim(ctx: &Context, want: usize, budget: i64) -> Result<Claim, String> {
    let claim = async {
        let mut conn = Conn::get(&ctx.pool).await?;
        let rows = queue::claim(
            conn.client(),
            &ctx.claims,
            ctx.max_attempts,
            want as i64,
            budget,
            ctx.lease,
            ctx.db_timeout / 2,
        )
        .await
        .map_err(|e| describe_db_error(&e))?;
        conn.set_clean(true);
        Ok(rows)
    };
    // On timeout the connection is dropped unclean, so discarded; a claim that committed
    // meanwhile leaves its rows leased until the lease expires.
    tokio::time::timeout(ctx.db_timeout, claim)
        .await
        .unwrap_or_else(|_| Err(format!("claiming took longer than {:?}", ctx.db_timeout)))
}

/// Counts and logs the rows a claim parked: at the attempt limit, their last attempt ended without
/// an outcome (a worker died or lost its lease); or without a payload to process (an unstorable
/// body whose hold was cleared by hand). Their `last_error` says which.
fn report_parked(ctx: &Context, parked: &[Claimed]) {
    ctx.metrics.events(EventOutcome::Parked, parked.len() as u64);
    for row in parked {
        tracing::warn!(
            outcome = EventOutcome::Parked.as_str(),
            provider = %row.key.provider,
            endpoint = %row.key.endpoint,
            event_id = %row.key.event_id,
            event_type = %row.event_type,
            attempt = row.attempts,
            "event parked for review by the claim: its last allowed attempt ended without an outcome, \
             or it has no payload (see its last_error)"
        );
    }
}

/// Runs one claimed batch: hands it back if shutdown began before it started, else executes it
/// in one transaction, records its failures in one more, and counts and logs each event's outcome.
async fn process_batch(ctx: &Context, claimed: Vec<Claimed>) {
    let mut conn = match Conn::get(&ctx.pool).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, rows = claimed.len(), "no connection for claimed rows; they are retried after their lease");
            return;
        }
    };
    if ctx.shutdown.is_cancelled() {
        conn.set_clean(true);
        drop(conn);
        let handed = tokio::time::timeout(ctx.db_timeout, completer::hand_back(&ctx.pool, &claimed))
            .await
            .unwrap_or_else(|_| {
                tracing::warn!(rows = claimed.len(), "handing back timed out: the leases will expire");
                0
            });
        ctx.metrics.events(EventOutcome::HandedBack, handed);
        tracing::info!(
            outcome = EventOutcome::HandedBack.as_str(),
            rows = handed,
            "claimed rows handed back at shutdown"
        );
        return;
    }
    let n = claimed.len() as i64;
    ctx.metrics.in_flight.inc_by(n);
    let started = Instant::now();
    let outcomes = executor::execute_batch(&mut conn, &ctx.registry, &claimed, &ctx.limits).await;
    let elapsed = started.elapsed();
    ctx.metrics.in_flight.dec_by(n);
    ctx.metrics.processing_seconds.observe(elapsed.as_secs_f64());

    let failures: Vec<Failure<'_>> = claimed
        .iter()
        .zip(&outcomes)
        .filter_map(|(claimed, outcome)| match outcome {
            Outcome::Failed(error) => Some(Failure { claimed, error }),
            _ => None,
        })
        .collect();
    let interrupted: Vec<Claimed> = claimed
        .iter()
        .zip(&outcomes)
        .filter(|(_, outcome)| matches!(outcome, Outcome::Interrupted(_)))
        .map(|(claimed, _)| claimed.clone())
        .collect();
    let returned = match outcomes.iter().find_map(|o| match o {
        Outcome::Interrupted(error) => Some(error.as_str()),
        _ => None,
    }) {
        // A whole batch is interrupted at once: one error for all its rows.
        Some(error) => {
            let give_back = completer::return_interrupted(&ctx.pool, &interrupted, error, ctx.max_attempts);
            tokio::time::timeout(ctx.db_timeout * 2, give_back).await.unwrap_or(0)
        }
        None => 0,
    };
    let mut records = if failures.is_empty() {
        Vec::new()
    } else {
        let record = completer::record_failures(&ctx.pool, Some(conn), &failures, ctx.max_attempts);
        tokio::time::timeout(ctx.db_timeout, record)
            .await
            .unwrap_or_else(|_| vec![FailureRecord::NotRecorded; failures.len()])
    }
    .into_iter();

    for (row, outcome) in claimed.iter().zip(&outcomes) {
        let key = &row.key;
        let span = tracing::info_span!(
            "event",
            provider = %key.provider,
            endpoint = %key.endpoint,
            event_id = %key.event_id,
            event_type = %row.event_type,
            attempt = row.attempts,
        );
        let _entered = span.enter();
        match outcome {
            Outcome::Processed | Outcome::Ignored => {
                let counted = if *outcome == Outcome::Processed {
                    EventOutcome::Processed
                } else {
                    EventOutcome::Ignored
                };
                let waited = SystemTime::now().duration_since(row.received_at).unwrap_or_default();
                ctx.metrics.receive_to_processed_seconds.observe(waited.as_secs_f64());
                ctx.metrics.events(counted, 1);
                tracing::info!(
                    outcome = counted.as_str(),
                    batch = n,
                    elapsed_ms = inbox_domain::telemetry::millis(elapsed),
                    "event done"
                );
            }
            Outcome::AlreadyProcessed => {
                ctx.metrics.events(EventOutcome::AlreadyProcessed, 1);
                tracing::info!(
                    outcome = EventOutcome::AlreadyProcessed.as_str(),
                    "event already processed by another worker"
                );
            }
            Outcome::Interrupted(error) if error.contains(inbox_domain::db::POOLER_FIX) => {
                ctx.metrics.events(EventOutcome::Interrupted, 1);
                tracing::error!(
                    outcome = EventOutcome::Interrupted.as_str(),
                    %error,
                    attempt_returned = returned as usize == interrupted.len(),
                    "event interrupted: the database settings are wrong"
                );
            }
            Outcome::Interrupted(error) => {
                ctx.metrics.events(EventOutcome::Interrupted, 1);
                tracing::warn!(
                    outcome = EventOutcome::Interrupted.as_str(),
                    %error,
                    attempt_returned = returned as usize == interrupted.len(),
                    "event interrupted by an infrastructure fault"
                );
            }
            Outcome::Failed(error) => {
                let record = records.next().unwrap_or(FailureRecord::NotRecorded);
                if record == FailureRecord::Parked {
                    ctx.metrics.events(EventOutcome::Parked, 1);
                    tracing::warn!(
                        outcome = EventOutcome::Parked.as_str(),
                        %error,
                        "event failed at the attempt limit: parked for review"
                    );
                } else {
                    ctx.metrics.events(EventOutcome::Failed, 1);
                    tracing::warn!(outcome = EventOutcome::Failed.as_str(), %error, record = ?record, "event failed");
                }
            }
        }
    }
}
