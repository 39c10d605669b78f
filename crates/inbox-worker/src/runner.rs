//! `run`: wires the producer, the executors, the completer, the wake-up listener, the metrics
//! and the shutdown signal, and drains at shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use inbox_domain::db::{
    build_pool, check_reachable, describe_db_error, describe_pool_error, discard, within, DatabaseConfig,
    PoolOptions, Pooler,
};
use inbox_domain::handler::Registry;
use inbox_domain::inbox::store::{gauges, reconciliation, workers};
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::executor::Limits;
use crate::metrics::{self, Metrics};
use crate::producer::{self, Capacity, Context};

/// Validated settings of `run`.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The inbox database and how to reach it (its Debug output redacts the password).
    pub database: DatabaseConfig,
    pub max_attempts: i32,
    /// Events, transactions and payload bytes in flight at once.
    pub capacity: Capacity,
    pub lease: Duration,
    pub limits: Limits,
    pub poll_interval: Duration,
    pub metrics_listen: Option<SocketAddr>,
    pub shutdown_timeout: Duration,
    /// The binary's name, recorded with what this worker claims (`inbox_workers.program`).
    pub program: String,
    /// `fetch`: what gets the objects of thin events before their batch is applied.
    pub fetcher: Option<Arc<crate::fetch::Fetcher>>,
}

impl Settings {
    /// Checks the flags; refuses a statement timeout that is not well under the lease (a
    /// handler still running when its lease expires would race the next claimer for the row).
    pub fn from_args(database: DatabaseConfig, max_attempts: i32, args: &RunArgs) -> anyhow::Result<Self> {
        if args.statement_timeout.is_zero() || args.lease.is_zero() {
            anyhow::bail!("--statement-timeout and --lease must be above 0");
        }
        if args.statement_timeout * 2 > args.lease {
            anyhow::bail!(
                "--statement-timeout ({}) must be at most half of --lease ({})",
                humantime::format_duration(args.statement_timeout),
                humantime::format_duration(args.lease)
            );
        }
        if args.poll_interval.is_zero() {
            anyhow::bail!("--poll-interval must be above 0");
        }
        let pooler = database.pooler;
        if args.max_bytes_in_flight == 0 {
            anyhow::bail!("--max-bytes-in-flight must be above 0");
        }
        Ok(Settings {
            database,
            max_attempts,
            capacity: Capacity::new(
                args.concurrency as usize,
                args.batch_size as usize,
                args.max_bytes_in_flight,
            ),
            lease: args.lease,
            limits: Limits {
                pooler,
                statement_timeout: args.statement_timeout,
                lock_timeout: args.statement_timeout / 2,
                idle_timeout: args.statement_timeout,
                deadline: args.lease * 3 / 4,
            },
            poll_interval: args.poll_interval,
            metrics_listen: args.metrics_listen,
            shutdown_timeout: args.shutdown_timeout,
            program: "inbox-worker".to_owned(),
            fetcher: None,
        })
    }
}

/// A token cancelled at the first SIGTERM/SIGINT; a second signal exits at once (the leases of
/// rows in flight then expire and other workers take them).
pub fn os_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let first = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stop signal: no new claims, finishing events in flight (signal again to exit now)");
        first.cancel();
        wait_for_signal().await;
        tracing::warn!("second stop signal: exiting now; leases of events in flight will expire");
        std::process::exit(130);
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
        else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Processes until `shutdown` is cancelled, then drains.
pub async fn run(settings: Settings, registry: Registry, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with(settings, registry, shutdown, |_| async {}).await
}

/// [`run`], calling `ready` with the metrics address once everything started (for tests).
pub async fn run_with<F, Fut>(
    settings: Settings,
    registry: Registry,
    shutdown: CancellationToken,
    ready: F,
) -> anyhow::Result<()>
where
    F: FnOnce(Option<SocketAddr>) -> Fut,
    Fut: Future<Output = ()>,
{
    let db_timeout = settings.limits.statement_timeout.max(Duration::from_secs(5));
    let pool = build_pool(
        &settings.database,
        &PoolOptions {
            // One per process transaction in flight, plus the claims and the gauges (which the
            // statistics check shares: a few milliseconds every 30 s). A batch's failures are
            // recorded on its own connection when it is clean, else on a fresh one in its place.
            // (The wake-up listener has a connection of its own.)
            max_size: settings.capacity.transactions + 2,
            timeout: db_timeout,
            application_name: "inbox-worker",
            session_statement_timeout: None,
            // Directly, the whole session writes with write-back (its transactions with limits do
            // anyway, behind a pooler too): see store::SESSION_WRITE_BACK_SQL.
            session_write_back: settings.database.pooler == Pooler::None,
            // Every use below is bounded by a deadline (`Context::db_timeout`, the executor's
            // `Limits::deadline`) and a connection is discarded after any error, so the round
            // trip a verification costs on every checkout buys nothing here.
            verify_on_checkout: false,
        },
    )?;
    check_reachable(&pool, &settings.database).await?;
    check_schema(&pool).await?;

    // Say what this worker claims before claiming anything: the rows of the other types are then
    // counted as waiting for a handler (stats, inbox_no_handler), not mistaken for a backlog.
    let claims = registry.claim_filter();
    let worker_id = worker_id();
    register(&pool, &worker_id, &settings.program, &registry).await?;
    if !claims.all && claims.exact.is_empty() && claims.prefixes.is_empty() {
        tracing::warn!("this worker handles and ignores no event type: it will claim nothing");
    }
    tracing::info!(
        handles = ?registry.event_types(),
        ignores = ?registry.ignore_patterns().iter().map(ToString::to_string).collect::<Vec<_>>(),
        "claiming the event types handled or ignored; others wait for a worker that handles them"
    );

    let metrics = Metrics::new();
    let metrics_server = match settings.metrics_listen {
        Some(address) => {
            let rendered = metrics.clone();
            let (handle, bound) =
                metrics::serve(address, move || rendered.render(), metrics.heartbeat.clone())
                    .with_context(|| format!("serving metrics on {address}"))?;
            Some((handle, bound))
        }
        None => None,
    };
    let background = CancellationToken::new();
    if metrics_server.is_some() {
        tokio::spawn(metrics.heartbeat.clone().run(background.clone()));
        tokio::spawn(refresh_gauges(
            pool.clone(),
            settings.database.clone(),
            metrics.clone(),
            background.clone(),
        ));
    }
    // At start and then periodically, metrics served or not: the queue tables analysed again
    // after PostgreSQL lost its statistics (a crash restart), so that autovacuum sees their dead
    // tuples.
    tokio::spawn(crate::statistics::run(
        pool.clone(),
        settings.database.clone(),
        metrics.clone(),
        background.clone(),
    ));
    tokio::spawn(keep_registered(
        pool.clone(),
        worker_id.clone(),
        settings.program.clone(),
        registry.clone(),
        background.clone(),
    ));
    let wake = crate::listener::spawn(
        &settings.database,
        crate::listener::INBOX,
        settings.poll_interval,
        background.clone(),
    );

    tracing::info!(
        concurrency = settings.capacity.events,
        batch_size = settings.capacity.batch_size,
        transactions = settings.capacity.transactions,
        max_bytes_in_flight = settings.capacity.bytes,
        max_attempts = settings.max_attempts,
        lease_s = settings.lease.as_secs_f64(),
        statement_timeout_s = settings.limits.statement_timeout.as_secs_f64(),
        metrics = %metrics_server.as_ref().map_or_else(|| "off".to_owned(), |(_, a)| a.to_string()),
        program = settings.program,
        "inbox-worker running"
    );
    ready(metrics_server.as_ref().map(|(_, a)| *a)).await;

    let ctx = Arc::new(Context {
        pool: pool.clone(),
        registry,
        claims,
        limits: settings.limits,
        max_attempts: settings.max_attempts,
        lease: settings.lease,
        db_timeout,
        metrics,
        shutdown: shutdown.clone(),
        outage: inbox_domain::db::OutageLog::new(settings.database.target()),
        wake_relays: producer::RelayWake::new(RELAY_NOTIFY_INTERVAL),
        fetcher: settings.fetcher.clone(),
    });
    let in_flight = producer::run(ctx, settings.capacity, settings.poll_interval, wake).await;
    producer::drain(
        in_flight,
        settings.shutdown_timeout,
        "events in flight (rolled back; retried after their lease)",
    )
    .await;
    background.cancel();
    if let Some((handle, _)) = metrics_server {
        handle.stop(true).await;
    }
    // Gone: the types only this worker claimed count as having no handler from now on.
    let unregister = async {
        let client = pool.get().await.map_err(|e| describe_pool_error(&e))?;
        workers::unregister(&**client, &worker_id).await.map_err(|e| describe_db_error(&e))
    };
    match tokio::time::timeout(db_timeout, unregister).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = e, "could not remove this worker's row (it expires in a minute)")
        }
        Err(_) => tracing::warn!("removing this worker's row timed out (it expires in a minute)"),
    }
    pool.close();
    tracing::info!(program = settings.program, "inbox-worker stopped");
    Ok(())
}

/// Shortest gap between two wake-ups of the relays from one worker process (see
/// [`producer::RelayWake`]).
pub const RELAY_NOTIFY_INTERVAL: Duration = Duration::from_millis(20);

/// Refuses to run on a schema older than this build's (every claim would fail on a missing table
/// or column, over and over); warns on a newer one.
pub(crate) async fn check_schema(pool: &deadpool_postgres::Pool) -> anyhow::Result<()> {
    let client = pool
        .get()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", describe_pool_error(&e)))?;
    match inbox_domain::inbox::schema::state(&client).await {
        Ok(state @ inbox_domain::inbox::schema::SchemaState::Older { .. }) => {
            anyhow::bail!("{}", state.message().unwrap_or_default())
        }
        Ok(state) => {
            if let Some(message) = state.message() {
                tracing::warn!("{message}");
            }
            Ok(())
        }
        // A role that may not read the version table can still work: said, and on.
        Err(e) => {
            tracing::warn!(error = format!("{e:#}"), "could not check the schema version");
            Ok(())
        }
    }
}

/// This process's id in `inbox_workers`: host, process id and start time (unique across
/// restarts and hosts).
fn worker_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_owned());
    let started =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    format!("{host}:{}:{started}", std::process::id())
}

/// Writes this worker's row (see `store::workers`); a start-up refusal when it cannot.
async fn register(
    pool: &deadpool_postgres::Pool,
    id: &str,
    program: &str,
    registry: &Registry,
) -> anyhow::Result<()> {
    let client = pool
        .get()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", describe_pool_error(&e)))?;
    workers::register(&**client, id, program, registry)
        .await
        .map_err(|e| inbox_domain::db::db_error("recording what this worker claims (inbox_workers)", &e))
}

/// How often a worker refreshes its row: well within [`workers::LIVE_FOR`].
pub const REGISTER_INTERVAL: Duration = Duration::from_secs(10);

/// Refreshes this worker's row every [`REGISTER_INTERVAL`] until `stop`; a failed refresh is
/// logged and tried again at the next interval.
async fn keep_registered(
    pool: deadpool_postgres::Pool,
    id: String,
    program: String,
    registry: Registry,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(REGISTER_INTERVAL) => {}
        }
        let refresh = register(&pool, &id, &program, &registry);
        match tokio::time::timeout(REGISTER_INTERVAL, refresh).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = format!("{e:#}"), "refreshing this worker's row failed"),
            Err(_) => tracing::warn!("refreshing this worker's row timed out"),
        }
    }
}

/// Refreshes the queue gauges every [`metrics::GAUGE_INTERVAL`]: counted by one worker per
/// interval, read by the others (`store::gauges`). A refresh that outlives the interval is
/// abandoned — its connection cancelled and discarded, not returned to the pool still running.
async fn refresh_gauges(
    pool: deadpool_postgres::Pool,
    database: DatabaseConfig,
    metrics: Metrics,
    stop: CancellationToken,
) {
    loop {
        match pool.get().await {
            Err(e) => {
                tracing::debug!(error = %describe_pool_error(&e), "refreshing queue gauges: no connection")
            }
            Ok(client) => {
                let deadline = tokio::time::Instant::now() + metrics::GAUGE_INTERVAL;
                let refresh = async |client: &mut deadpool_postgres::Object| {
                    gauges::refresh(client, metrics::GAUGE_INTERVAL).await
                };
                match within(client, deadline, &database, refresh).await {
                    Some((_, Ok((g, _counted)))) => {
                        metrics.unprocessed.set(g.unprocessed);
                        metrics.ready.set(g.ready);
                        metrics.needs_review.set(g.needs_review);
                        metrics.no_handler.set(g.no_handler);
                        metrics.oldest_unprocessed_age_seconds.set(g.oldest_unprocessed_age_seconds);
                    }
                    Some((client, Err(e))) => {
                        tracing::debug!(error = %describe_db_error(&e), "refreshing queue gauges failed");
                        discard(client);
                    }
                    None => tracing::debug!("refreshing queue gauges timed out: cancelled"),
                }
            }
        }
        refresh_open_items(&pool, &database, &metrics).await;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(metrics::GAUGE_INTERVAL) => {}
        }
    }
}

/// Counts the open reconciliation items for `inbox_reconciliation_items_open`, on a connection of
/// its own: a failure here (a role without SELECT on reconciliation_items, say) leaves the queue
/// gauges as they are. Every worker counts (an index count of the open items, see
/// `store::reconciliation::open_count`); a count that outlives the interval is abandoned as above.
async fn refresh_open_items(pool: &deadpool_postgres::Pool, database: &DatabaseConfig, metrics: &Metrics) {
    let client = match pool.get().await {
        Ok(client) => client,
        Err(e) => {
            tracing::debug!(error = %describe_pool_error(&e), "counting open reconciliation items: no connection");
            return;
        }
    };
    let deadline = tokio::time::Instant::now() + metrics::GAUGE_INTERVAL;
    let count = async |client: &mut deadpool_postgres::Object| {
        reconciliation::open_count(client, metrics::GAUGE_INTERVAL).await
    };
    match within(client, deadline, database, count).await {
        Some((_, Ok(open))) => {
            metrics.reconciliation_items_open.set(open);
        }
        Some((client, Err(e))) => {
            tracing::debug!(error = %describe_db_error(&e), "counting open reconciliation items failed");
            discard(client);
        }
        None => tracing::debug!("counting open reconciliation items timed out: cancelled"),
    }
}
