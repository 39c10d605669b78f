//! The producer: claims ready rows (transaction 1) as capacity frees up, and hands each to an
//! executor task. It stops claiming the moment shutdown starts.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use inbox_domain::budget::ByteBudget;
use inbox_domain::db::{describe_db_error, OutageLog};
use inbox_domain::handler::{ClaimFilter, Registry};
use inbox_domain::inbox::store::cursor::ClaimCursor;
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
    /// Wakes the relays after a batch that processed events: their handlers may have written
    /// outbox rows, which the relays then look for at once.
    pub wake_relays: RelayWake,
    /// `fetch`: gets the objects a batch's thin events name before the batch is applied.
    pub fetcher: Option<Arc<crate::fetch::Fetcher>>,
}

/// At most one wake-up of the relays (`NOTIFY outbox`) per interval from this worker, sent by the
/// batch that finds it due, on its own connection once its transaction committed: waking them
/// never takes a connection from the pool, and never adds a NOTIFY to a processing transaction
/// (each would take PostgreSQL's global notify lock at its commit and serialise the commits). A
/// row committed in the gap is found by the next wake-up, or by the relays' poll.
#[derive(Debug)]
pub struct RelayWake {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last wake-up, plus one interval (so the first is due).
    last_ms: std::sync::atomic::AtomicU64,
    interval_ms: u64,
}

impl RelayWake {
    pub fn new(interval: Duration) -> Self {
        RelayWake {
            epoch: Instant::now(),
            last_ms: Default::default(),
            interval_ms: interval.as_millis() as u64,
        }
    }

    /// True for the one caller that is to send the next wake-up.
    fn due(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.epoch.elapsed().as_millis() as u64 + self.interval_ms;
        let last = self.last_ms.load(Relaxed);
        now >= last + self.interval_ms && self.last_ms.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
    }
}

/// How much a worker takes on at once. A claim waits until all three have room.
#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    /// Events in flight (`--concurrency`).
    pub events: usize,
    /// Rows per process transaction (`--batch-size`, at most `events`), and per claim of one batch.
    pub batch_size: usize,
    /// Process transactions in flight, each on its own connection: `events / batch_size`,
    /// rounded up. Without this bound, rows arriving one at a time would make one transaction
    /// (and one connection) per event.
    pub transactions: usize,
    /// Payload bytes in flight (`--max-bytes-in-flight`): what bounds the worker's memory whatever
    /// the size of the events. A claim may go over by one row (it always takes at least one).
    pub bytes: u64,
    /// Batches one claim may take, each then worked by a task (and a transaction) of its own, as
    /// many as there are free transactions up to this. The producer makes one claim at a time:
    /// when rows wait and several batches ended during a claim (a backlog, or a machine slowed
    /// by something else), one claim of several batches costs PostgreSQL and the round trips
    /// less than as many claims, so the claims keep up instead of becoming what the rows wait
    /// for. With rows arriving slower than a batch per claim, every claim takes one batch or less.
    pub claim_batches: usize,
}

impl Capacity {
    pub fn new(events: usize, batch_size: usize, bytes: u64) -> Self {
        let batch_size = batch_size.clamp(1, events.max(1));
        let transactions = events.div_ceil(batch_size);
        Capacity { events, batch_size, transactions, bytes, claim_batches: transactions }
    }
}

/// A queue the producer claims from and hands batches of to tasks: the inbox (`run`, this
/// module's [`Context`]) or the outbox (`relay`). The producer owns what both share — capacity
/// (rows, transactions and bytes in flight), where each claim starts reading the queue (a
/// [`ClaimCursor`]), the wake-ups, the backoff of failing claims and the stop at shutdown; the
/// queue says how to claim and how to work a batch.
pub trait Work: Send + Sync + 'static {
    /// A claimed row.
    type Row: Send + 'static;
    /// Claims up to `want` rows whose bytes stay within `budget` (the first row always), reading
    /// the queue from `since` (None: from its front).
    fn claim(
        &self,
        want: usize,
        budget: i64,
        since: Option<SystemTime>,
    ) -> impl Future<Output = Result<Batch<Self::Row>, String>> + Send;
    /// What holding `row` costs in memory.
    fn bytes(row: &Self::Row) -> u64;
    /// Works one claimed batch to its end (each row's outcome recorded, or handed back at
    /// shutdown), holding `held` meanwhile: dropped at the end at the latest; a queue whose rows
    /// end one by one may give back each row's place as it ends (`held.rows.split(1)`), so that
    /// the next claim need not wait for the batch's slowest row.
    fn process(self: Arc<Self>, rows: Vec<Self::Row>, held: Held) -> impl Future<Output = ()> + Send;
    /// Cancelled at the first stop signal.
    fn shutdown(&self) -> &CancellationToken;
    /// Where failing claims are said, once per outage.
    fn outage(&self) -> &OutageLog;
    /// Counts a claim's size (a metric).
    fn observe_claim(&self, rows: usize);
}

/// The capacity a batch holds while it is worked.
pub struct Held {
    /// One place per row (of `--concurrency`).
    pub rows: tokio::sync::OwnedSemaphorePermit,
    /// The batch's transaction (of `Capacity::transactions`).
    pub transaction: tokio::sync::OwnedSemaphorePermit,
    /// Its payload bytes (of `--max-bytes-in-flight`).
    pub bytes: inbox_domain::budget::BytesHeld,
}

/// What a claim came to, for the producer.
pub struct Batch<R> {
    pub rows: Vec<R>,
    /// The claim took as many places as it was given (rows claimed, and rows it parked or held):
    /// more may be ready, so the producer claims again at once.
    pub full: bool,
    /// Where the next claim may start reading the queue (the claim's `resume_from`).
    pub resume_from: Option<SystemTime>,
}

/// Claims and dispatches until shutdown; returns the tasks still in flight.
pub async fn run<W: Work>(
    work: Arc<W>,
    capacity: Capacity,
    poll_interval: Duration,
    wake: Arc<Notify>,
) -> JoinSet<()> {
    let events = Arc::new(Semaphore::new(capacity.events));
    let transactions = Arc::new(Semaphore::new(capacity.transactions));
    let payloads = ByteBudget::new(capacity.bytes);
    let mut tasks = JoinSet::new();
    let shutdown = work.shutdown().clone();
    let mut retry_delay = poll_interval.min(Duration::from_millis(500));
    // While batches are in flight, a claim waits for room for half a batch: places given back
    // row by row (the relay's) would otherwise make claims of a row or two, each a round trip.
    let min_claim = capacity.batch_size.div_ceil(2).max(1);
    let mut cursor = ClaimCursor::new();
    loop {
        while let Some(done) = tasks.try_join_next() {
            report_task_end(done);
        }
        if shutdown.is_cancelled() {
            break;
        }
        let (free_events, free_bytes) = (events.available_permits(), payloads.available());
        let short = free_events < min_claim && !tasks.is_empty();
        if free_events == 0 || free_bytes == 0 || transactions.available_permits() == 0 || short {
            // Every task returns its capacity when it ends; some return places before.
            let need = min_claim as u32;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(done) = tasks.join_next() => report_task_end(done),
                Ok(room) = events.acquire_many(need), if free_events < min_claim => drop(room),
            }
            continue;
        }
        let batches = transactions.available_permits().min(capacity.claim_batches).max(1);
        let want = free_events.min(capacity.batch_size * batches);
        let budget = i64::try_from(free_bytes).unwrap_or(i64::MAX);
        let batch = match work.claim(want, budget, cursor.start()).await {
            Ok(batch) => {
                cursor.advance(batch.resume_from);
                work.outage().succeeded();
                retry_delay = poll_interval.min(Duration::from_millis(500));
                batch
            }
            Err(e) => {
                if e.contains(inbox_domain::db::POOLER_FIX) {
                    tracing::error!(error = %e, "claim failed: the database settings are wrong; retrying");
                } else {
                    work.outage().failed("claiming (retried with backoff)", &e);
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(retry_delay) => {}
                }
                retry_delay = (retry_delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let Batch { mut rows, full, .. } = batch;
        work.observe_claim(rows.len());
        // Batches of --batch-size in the claim's order, each worked by its own task; the claim
        // took no more rows than free places, and no more batches than free transactions.
        while !rows.is_empty() {
            let rest = rows.split_off(rows.len().min(capacity.batch_size));
            let batch = std::mem::replace(&mut rows, rest);
            let bytes: u64 = batch.iter().map(W::bytes).sum();
            // The claim stopped at the free budget but for its last row: charge what is free at most.
            let k = payloads.take_available(bytes);
            let permits = (
                events.clone().try_acquire_many_owned(batch.len() as u32),
                transactions.clone().try_acquire_owned(),
            );
            let (Ok(e), Ok(t)) = permits else {
                unreachable!("only this loop takes capacity, and it claimed within what was free")
            };
            let work = work.clone();
            tasks.spawn(async move {
                work.process(batch, Held { rows: e, transaction: t, bytes: k }).await;
            });
        }
        if full {
            continue; // More may be ready: claim again as soon as there is room.
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(poll_interval) => {}
        }
    }
    tasks
}

/// After [`run`] returned: waits up to `timeout` for the tasks still in flight, then aborts the
/// rest, saying `abandoned` (what becomes of their rows).
pub async fn drain(mut in_flight: JoinSet<()>, timeout: Duration, abandoned: &str) {
    tracing::info!(in_flight = in_flight.len(), "stopped claiming; draining");
    let drained =
        tokio::time::timeout(timeout, async { while in_flight.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(still_running = in_flight.len(), "shutdown timeout reached: abandoning {abandoned}");
        in_flight.abort_all();
        while in_flight.join_next().await.is_some() {}
    }
}

impl Work for Context {
    type Row = Claimed;

    async fn claim(
        &self,
        want: usize,
        budget: i64,
        since: Option<SystemTime>,
    ) -> Result<Batch<Claimed>, String> {
        let claim = claim(self, want, budget, since).await?;
        report_parked(self, &claim.parked);
        // Rows the claim parked took places of its limit too: then more may be ready as well.
        let full = claim.claimed.len() + claim.parked.len() == want;
        Ok(Batch { rows: claim.claimed, full, resume_from: claim.resume_from })
    }

    fn bytes(row: &Claimed) -> u64 {
        row.bytes.max(0) as u64
    }

    async fn process(self: Arc<Self>, rows: Vec<Claimed>, held: Held) {
        // One transaction for the batch: its places come back together, when it ends.
        process_batch(&self, rows).await;
        drop(held);
    }

    fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    fn outage(&self) -> &OutageLog {
        &self.outage
    }

    fn observe_claim(&self, rows: usize) {
        self.metrics.claim_batch_size.observe(rows as f64);
    }
}

fn report_task_end(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "event task ended abnormally");
    }
}

async fn claim(ctx: &Context, want: usize, budget: i64, since: Option<SystemTime>) -> Result<Claim, String> {
    let claim = async {
        let mut conn = Conn::get(&ctx.pool).await?;
        let started = Instant::now();
        let rows = queue::claim(
            conn.client(),
            ctx.limits.pooler,
            &ctx.claims,
            since,
            ctx.max_attempts,
            want as i64,
            budget,
            ctx.lease,
            ctx.db_timeout / 2,
        )
        .await
        .map_err(|e| describe_db_error(&e))?;
        ctx.metrics.claim_seconds.observe(started.elapsed().as_secs_f64());
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
    // `fetch`: the objects first, outside any transaction; rows whose object could not be had
    // fail their attempt without running.
    let (claimed, fetch_failures) = match &ctx.fetcher {
        None => (claimed, Vec::new()),
        Some(fetcher) => match fetcher.prepare(&ctx.pool, claimed.clone()).await {
            Ok(prepared) => (prepared.ready, prepared.failed),
            Err(error) => {
                let error = format!("interrupted, attempt not counted: {error}");
                (Vec::new(), claimed.into_iter().map(|c| (c, error.clone())).collect())
            }
        },
    };
    let mut outcomes = if claimed.is_empty() {
        conn.set_clean(true);
        Vec::new()
    } else {
        executor::execute_batch(&mut conn, &ctx.registry, &claimed, &ctx.limits).await
    };
    let mut claimed = claimed;
    for (row, error) in fetch_failures {
        outcomes.push(if error.starts_with("interrupted") {
            Outcome::Interrupted(error)
        } else {
            Outcome::Failed(error)
        });
        claimed.push(row);
    }
    let elapsed = started.elapsed();
    ctx.metrics.in_flight.dec_by(n);
    if outcomes.contains(&Outcome::Processed) && conn.is_clean() && ctx.wake_relays.due() {
        if let Err(e) = conn.client().batch_execute(inbox_domain::inbox::store::outbox::NOTIFY_SQL).await {
            tracing::debug!(error = %describe_db_error(&e), "relay wake-up NOTIFY failed (relays also poll)");
        }
    }
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
