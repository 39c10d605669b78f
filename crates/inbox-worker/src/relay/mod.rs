//! `relay`: delivers the rows the handlers wrote to `outbox` — to an HTTP receiver (Standard
//! Webhooks signing, [`http`]) or to a NATS JetStream stream ([`nats`]) — and marks them published.
//!
//! The relay is the worker's division of labour over another table: the same producer
//! ([`crate::producer::run`]) claims batches (transaction 1: SKIP LOCKED, attempt counted, lease,
//! fencing token), each batch's rows are delivered concurrently outside any transaction, each row
//! giving its place back to the producer as its delivery ends, and the rows that ended are marked
//! published (one statement) and their failures recorded (another) in waves, as they end (each
//! write fenced by its claim, so a relay whose lease ran out never marks or fails a row another
//! relay now holds).
//! Every statement is in `inbox_domain::inbox::store::outbox`.
//!
//! Delivery is at least once with a stable id (`webhook-id`, `Nats-Msg-Id` = the outbox id): a
//! relay killed between the delivery and the mark delivers the row again after its lease. Every
//! attempt carries a fencing token that grows with each claim of the row
//! ([`FENCING_TOKEN_HEADER`]), so a receiver with side effects of its own can refuse an attempt
//! older than one it already took. Rows of one aggregate are delivered one at a time, in id order.

pub mod http;
mod metrics;
pub mod nats;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use clap::Args;
use deadpool_postgres::Pool;
use inbox_domain::config::{parse_byte_size, parse_duration};
use inbox_domain::db::{
    build_pool, check_reachable, describe_db_error, DatabaseConfig, OutageLog, PoolOptions, Pooler,
};
use inbox_domain::inbox::store::outbox::{self, DeliveryFailure, Fence, OutboxClaimed};
use tokio_util::sync::CancellationToken;

use crate::conn::Conn;
use crate::producer::{Batch, Capacity, Held, Work};
pub use metrics::RelayMetrics;

/// The header (HTTP) and NATS header carrying each attempt's fencing token: a number that grows
/// with every claim of the row. A receiver that records the highest token it took per `webhook-id`
/// refuses an attempt with a lower one (a relay that lost its lease, delivering late).
pub const FENCING_TOKEN_HEADER: &str = "inbox-fencing-token";

/// Flags of `relay`.
#[derive(Debug, Args)]
pub struct RelayArgs {
    /// Deliver each row as an HTTP POST of its payload to this URL, signed as Standard Webhooks
    /// define (webhook-id, webhook-timestamp, webhook-signature). 2xx is delivered.
    #[arg(
        long,
        env = "INBOX_RELAY_URL",
        value_name = "URL",
        hide_env_values = true,
        required_unless_present = "to_nats",
        conflicts_with = "to_nats"
    )]
    pub to_url: Option<String>,

    /// The Standard Webhooks signing secret of --to-url: whsec_ and the base64 of 24 to 64 random
    /// bytes; comma-separated during a rotation (every attempt is signed with each).
    #[arg(
        long,
        env = "INBOX_RELAY_SECRET",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "whsec_…[,whsec_…]"
    )]
    pub signing_secret: Vec<String>,

    /// A file holding the signing secret(s), comma-separated or one per line (a mounted secret).
    #[arg(long, env = "INBOX_RELAY_SECRET_FILE", value_name = "PATH")]
    pub signing_secret_file: Option<std::path::PathBuf>,

    /// Deliver each row to NATS JetStream at this server URL (nats://host:4222, comma-separated
    /// for a cluster): published with Nats-Msg-Id = the outbox id, delivered when the stream acks.
    #[arg(long, env = "INBOX_RELAY_NATS", value_name = "URL", hide_env_values = true)]
    pub to_nats: Option<String>,

    /// The subject rows are published on (with --to-nats); a stream must capture it.
    #[arg(long, env = "INBOX_RELAY_SUBJECT", value_name = "SUBJECT", requires = "to_nats")]
    pub subject: Option<String>,

    /// Deliveries in flight at once in this process (at most one per aggregate): also the most
    /// requests a receiver gets at once from it. Twice the worker's default: a batch is marked
    /// once its slowest delivery ends, so more batches in flight keep the receiver busy meanwhile
    /// (`make bench`: at 256 a relay delivered below the worker's rate, at 512 above it).
    #[arg(long, env = "INBOX_RELAY_CONCURRENCY", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrency: u32,

    /// Rows claimed per transaction (capped at --concurrency); they are marked published in
    /// waves, as their deliveries end.
    #[arg(long, env = "INBOX_RELAY_BATCH", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub batch_size: u32,

    /// Payload bytes in flight at most: what bounds the relay's memory whatever the rows' size.
    #[arg(long, env = "INBOX_RELAY_MAX_BYTES_IN_FLIGHT", default_value = "32MiB",
          value_parser = parse_byte_size)]
    pub max_bytes_in_flight: u64,

    /// Attempts after which a row is parked for review (its aggregate's later rows wait behind it)
    /// until `requeue --outbox`. With the default backoff, 16 attempts span about 7 hours.
    #[arg(long, env = "INBOX_MAX_ATTEMPTS", default_value_t = 16,
          value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,

    /// How long a claimed row stays invisible to other relays; at least twice --delivery-timeout.
    #[arg(long, env = "INBOX_LEASE", default_value = "2m", value_parser = parse_duration)]
    pub lease: Duration,

    /// Longest wait for one delivery's answer (HTTP response, JetStream ack).
    #[arg(long, env = "INBOX_RELAY_DELIVERY_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub delivery_timeout: Duration,

    /// Backoff after a row's first failed attempt; doubled after each further one, up to
    /// --max-backoff, ±20 % jitter. A receiver's Retry-After is honoured when longer.
    #[arg(long, env = "INBOX_RELAY_BACKOFF", default_value = "5s", value_parser = parse_duration)]
    pub backoff: Duration,

    /// The longest backoff between two attempts of a row.
    #[arg(long, env = "INBOX_RELAY_MAX_BACKOFF", default_value = "1h", value_parser = parse_duration)]
    pub max_backoff: Duration,

    /// How often an idle relay looks for rows (it also wakes when workers write some).
    #[arg(long, env = "INBOX_POLL_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub poll_interval: Duration,

    /// Serve Prometheus metrics (and /healthz) on this address, e.g. 0.0.0.0:9091.
    #[arg(long, env = "INBOX_RELAY_METRICS", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// After SIGTERM/SIGINT, how long deliveries in flight may take to finish.
    #[arg(long, env = "INBOX_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
}

/// Where rows go.
#[derive(Debug, Clone)]
pub enum DestinationSpec {
    Http { url: String, secrets: Vec<String> },
    Nats { servers: String, subject: String },
}

/// Validated settings of `relay`.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The inbox database (its Debug output redacts the password).
    pub database: DatabaseConfig,
    pub destination: DestinationSpec,
    pub max_attempts: i32,
    pub capacity: Capacity,
    pub lease: Duration,
    pub delivery_timeout: Duration,
    pub backoff: Backoff,
    pub poll_interval: Duration,
    pub metrics_listen: Option<SocketAddr>,
    pub shutdown_timeout: Duration,
}

impl Settings {
    /// Checks the flags and reads the secret file.
    pub fn from_args(database: DatabaseConfig, args: &RelayArgs) -> anyhow::Result<Self> {
        if args.lease.is_zero() || args.delivery_timeout.is_zero() || args.poll_interval.is_zero() {
            anyhow::bail!("--lease, --delivery-timeout and --poll-interval must be above 0");
        }
        if args.delivery_timeout * 2 > args.lease {
            anyhow::bail!(
                "--delivery-timeout ({}) must be at most half of --lease ({}): a delivery still waiting \
                 when its lease ends would be delivered again by another relay",
                humantime::format_duration(args.delivery_timeout),
                humantime::format_duration(args.lease)
            );
        }
        if args.backoff.is_zero() || args.max_backoff < args.backoff {
            anyhow::bail!("--backoff must be above 0 and at most --max-backoff");
        }
        if args.max_bytes_in_flight == 0 {
            anyhow::bail!("--max-bytes-in-flight must be above 0");
        }
        let destination = match (&args.to_url, &args.to_nats) {
            (Some(url), None) => {
                let mut secrets: Vec<String> = args
                    .signing_secret
                    .iter()
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect();
                if let Some(path) = &args.signing_secret_file {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("reading --signing-secret-file {}", path.display()))?;
                    secrets.extend(
                        text.split([',', '\n']).map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()),
                    );
                }
                DestinationSpec::Http { url: url.clone(), secrets }
            }
            (None, Some(servers)) => {
                if !args.signing_secret.is_empty() || args.signing_secret_file.is_some() {
                    anyhow::bail!("--signing-secret is for --to-url: JetStream deliveries are not signed");
                }
                let subject = args
                    .subject
                    .as_deref()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| anyhow::anyhow!("--to-nats needs --subject (INBOX_RELAY_SUBJECT)"))?;
                DestinationSpec::Nats { servers: servers.clone(), subject: subject.to_owned() }
            }
            _ => anyhow::bail!("give exactly one destination: --to-url (INBOX_RELAY_URL) or --to-nats"),
        };
        Ok(Settings {
            database,
            destination,
            max_attempts: args.max_attempts,
            capacity: Capacity {
                // Batches give back their rows' places one by one and hold no connection while
                // they deliver: the places bound them, not a number of transactions.
                transactions: args.concurrency as usize,
                // A claim takes one batch. Claims of several delivered no faster (`make bench`,
                // relay phase): places come back row by row, and a claim waits for half a batch.
                claim_batches: 1,
                ..Capacity::new(args.concurrency as usize, args.batch_size as usize, args.max_bytes_in_flight)
            },
            lease: args.lease,
            delivery_timeout: args.delivery_timeout,
            backoff: Backoff { first: args.backoff, max: args.max_backoff },
            poll_interval: args.poll_interval,
            metrics_listen: args.metrics_listen,
            shutdown_timeout: args.shutdown_timeout,
        })
    }
}

/// The wait after a failed attempt: `first`, doubled after each further failure, at most `max`
/// (the statement adds ±20 % jitter).
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The backoff after the failure of attempt `attempt` (1 for the first).
    pub fn after(&self, attempt: i32) -> Duration {
        let doublings = u32::try_from(attempt.saturating_sub(1)).unwrap_or(0).min(30);
        self.first.saturating_mul(1 << doublings).min(self.max)
    }
}

/// A failed delivery, as a destination reports it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// What happened: the receiver's answer, or the transport's error. Never a secret.
    pub error: String,
    /// The receiver's `Retry-After`.
    pub retry_after: Option<Duration>,
    /// Never retry: park the row now.
    pub park: bool,
}

impl Failure {
    pub fn retry(error: String) -> Self {
        Failure { error, retry_after: None, park: false }
    }

    pub fn park(error: String) -> Self {
        Failure { error, retry_after: None, park: true }
    }
}

/// A connected destination.
#[derive(Debug)]
pub enum Destination {
    Http(http::Http),
    Nats(nats::Nats),
}

impl Destination {
    /// Connects to the destination `spec` names; a start-up refusal when it cannot.
    pub async fn connect(spec: &DestinationSpec, timeout: Duration) -> anyhow::Result<Destination> {
        Ok(match spec {
            DestinationSpec::Http { url, secrets } => {
                Destination::Http(http::Http::new(url, secrets, timeout)?)
            }
            DestinationSpec::Nats { servers, subject } => {
                Destination::Nats(nats::Nats::connect(servers, subject, timeout).await?)
            }
        })
    }

    /// Delivers `row`: Ok once the destination acknowledged it.
    pub async fn deliver(&self, row: &OutboxClaimed) -> Result<(), Failure> {
        match self {
            Destination::Http(http) => http.deliver(row).await,
            Destination::Nats(nats) => nats.deliver(row).await,
        }
    }

    /// Where rows go, as logs show it (no credentials).
    pub fn describe(&self) -> String {
        match self {
            Destination::Http(http) => http.shown().to_owned(),
            Destination::Nats(nats) => nats.describe(),
        }
    }
}

/// What every batch task of a relay shares.
pub struct Relay {
    pool: Pool,
    destination: Destination,
    max_attempts: i32,
    lease: Duration,
    backoff: Backoff,
    /// Bound on each claim and mark (as the worker's `db_timeout`).
    db_timeout: Duration,
    /// Behind a transaction pooler the claim is sent unnamed, else prepared (`outbox::claim`).
    pooler: Pooler,
    metrics: RelayMetrics,
    shutdown: CancellationToken,
    outage: OutageLog,
}

/// Delivers until `shutdown` is cancelled, then drains.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with(settings, shutdown, |_| async {}).await
}

/// [`run`], calling `ready` with the metrics address once everything started (for tests).
pub async fn run_with<F, Fut>(settings: Settings, shutdown: CancellationToken, ready: F) -> anyhow::Result<()>
where
    F: FnOnce(Option<SocketAddr>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let db_timeout = Duration::from_secs(10);
    let pool = build_pool(
        &settings.database,
        &PoolOptions {
            // Batches hold no connection while they deliver, only for their mark (a few
            // milliseconds): four for the marks of the batches in flight, plus the claims and the
            // gauges.
            max_size: settings.capacity.transactions.min(4) + 2,
            timeout: db_timeout,
            application_name: "inbox-relay",
            session_statement_timeout: None,
            // Directly, the whole session writes with write-back (its transactions with limits do
            // anyway, behind a pooler too): see store::SESSION_WRITE_BACK_SQL.
            session_write_back: settings.database.pooler == Pooler::None,
            verify_on_checkout: false,
        },
    )?;
    check_reachable(&pool, &settings.database).await?;
    crate::runner::check_schema(&pool).await?;
    let destination = Destination::connect(&settings.destination, settings.delivery_timeout).await?;
    if let Destination::Nats(nats) = &destination {
        let (stream, window) = nats.stream().await?;
        // A retry after the window is stored twice: the longest gap between two attempts of a row
        // is the longest backoff, or a lease that ran out.
        let widest_gap = settings.backoff.max.max(settings.lease);
        if window < widest_gap {
            tracing::warn!(
                stream,
                duplicate_window_s = window.as_secs_f64(),
                widest_retry_gap_s = widest_gap.as_secs_f64(),
                "the stream's duplicate window is shorter than the longest gap between two attempts of a row \
                 (--max-backoff, --lease): a retry after the window is stored twice; widen the window \
                 (it may not exceed the stream's max_age) or lower --max-backoff"
            );
        }
    }

    let metrics = RelayMetrics::new(match &destination {
        Destination::Http(_) => "http",
        Destination::Nats(_) => "nats",
    });
    let metrics_server = match settings.metrics_listen {
        Some(address) => {
            let rendered = metrics.clone();
            let (handle, bound) =
                crate::metrics::serve(address, move || rendered.render(), metrics.heartbeat.clone())
                    .with_context(|| format!("serving metrics on {address}"))?;
            Some((handle, bound))
        }
        None => None,
    };
    let background = CancellationToken::new();
    if metrics_server.is_some() {
        tokio::spawn(metrics.heartbeat.clone().run(background.clone()));
        tokio::spawn(metrics::refresh_gauges(
            pool.clone(),
            settings.database.clone(),
            metrics.clone(),
            background.clone(),
        ));
    }
    let wake = crate::listener::spawn(
        &settings.database,
        crate::listener::OUTBOX,
        settings.poll_interval,
        background.clone(),
    );
    tracing::info!(
        destination = destination.describe(),
        concurrency = settings.capacity.events,
        batch_size = settings.capacity.batch_size,
        max_attempts = settings.max_attempts,
        lease_s = settings.lease.as_secs_f64(),
        delivery_timeout_s = settings.delivery_timeout.as_secs_f64(),
        metrics = %metrics_server.as_ref().map_or_else(|| "off".to_owned(), |(_, a)| a.to_string()),
        "inbox-relay running"
    );
    ready(metrics_server.as_ref().map(|(_, a)| *a)).await;

    let relay = Arc::new(Relay {
        pool: pool.clone(),
        destination,
        max_attempts: settings.max_attempts,
        lease: settings.lease,
        backoff: settings.backoff,
        db_timeout,
        pooler: settings.database.pooler,
        metrics,
        shutdown: shutdown.clone(),
        outage: OutageLog::new(settings.database.target()),
    });
    let in_flight = crate::producer::run(relay, settings.capacity, settings.poll_interval, wake).await;
    crate::producer::drain(
        in_flight,
        settings.shutdown_timeout,
        "deliveries in flight (delivered again after their lease)",
    )
    .await;
    background.cancel();
    if let Some((handle, _)) = metrics_server {
        handle.stop(true).await;
    }
    pool.close();
    tracing::info!("inbox-relay stopped");
    Ok(())
}

/// How a claimed outbox row ended, as counted in `inbox_relay_deliveries_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// Delivered and marked published.
    Delivered,
    /// Delivered, but its lease had passed to another relay before the mark: that relay delivers
    /// and marks it (the receiver sees the id twice).
    Superseded,
    /// Delivered, but the mark could not be written (database down): delivered again after the
    /// lease.
    Unmarked,
    /// Not delivered; retried after its backoff.
    Failed,
    /// Not delivered at its last allowed attempt (or 410 Gone): parked until requeued.
    Parked,
    /// Claimed but not started before shutdown: returned with its attempt.
    HandedBack,
}

impl DeliveryOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryOutcome::Delivered => "delivered",
            DeliveryOutcome::Superseded => "superseded",
            DeliveryOutcome::Unmarked => "unmarked",
            DeliveryOutcome::Failed => "failed",
            DeliveryOutcome::Parked => "parked",
            DeliveryOutcome::HandedBack => "handed_back",
        }
    }
}

impl Work for Relay {
    type Row = OutboxClaimed;

    async fn claim(
        &self,
        want: usize,
        budget: i64,
        since: Option<SystemTime>,
    ) -> Result<Batch<OutboxClaimed>, String> {
        let claim = async {
            let mut conn = Conn::get(&self.pool).await?;
            let claim = outbox::claim(
                conn.client(),
                self.pooler,
                since,
                self.max_attempts,
                want as i64,
                budget,
                self.lease,
                self.db_timeout / 2,
            )
            .await
            .map_err(|e| describe_db_error(&e))?;
            conn.set_clean(true);
            Ok(claim)
        };
        let claim = tokio::time::timeout(self.db_timeout, claim)
            .await
            .unwrap_or_else(|_| Err(format!("claiming took longer than {:?}", self.db_timeout)))?;
        self.metrics.deliveries(DeliveryOutcome::Parked, claim.parked.len() as u64);
        for row in &claim.parked {
            tracing::warn!(
                outcome = DeliveryOutcome::Parked.as_str(),
                outbox_id = row.id,
                aggregate_type = %row.aggregate_type,
                aggregate_id = %row.aggregate_id,
                event_type = %row.event_type,
                attempt = row.attempts,
                "outbox row parked by the claim: its last allowed attempt ended without an outcome"
            );
        }
        let full = claim.claimed.len() + claim.parked.len() + claim.held == want;
        Ok(Batch { rows: claim.claimed, full, resume_from: claim.resume_from })
    }

    fn bytes(row: &OutboxClaimed) -> u64 {
        row.bytes.max(0) as u64
    }

    async fn process(self: Arc<Self>, rows: Vec<OutboxClaimed>, held: Held) {
        deliver_batch(&self, rows, held).await;
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

/// Rows delivered (or failed) together are marked together, in waves: a wave is written once
/// this many rows ended, or [`WAVE_LINGER`] after the first of them ended. A slow receiver then
/// holds back the mark of its own row only, not of the whole batch.
const WAVE_ROWS: usize = 128;
/// See [`WAVE_ROWS`].
const WAVE_LINGER: Duration = Duration::from_millis(10);

/// Delivers a claimed batch, each row concurrently (at most one per aggregate: the claim took
/// only first rows), giving back each row's place as its delivery ends, so that the next claim
/// need not wait for the batch's slowest receiver; the rows that ended are marked published (and
/// the failures recorded) in waves of [`WAVE_ROWS`], one statement each. Handed back unstarted if
/// shutdown began first.
async fn deliver_batch(relay: &Relay, rows: Vec<OutboxClaimed>, held: Held) {
    use futures_util::StreamExt as _;

    if relay.shutdown.is_cancelled() {
        let fences: Vec<Fence> = rows.iter().map(Fence::from).collect();
        let handed = with_retries(relay, "hand back claimed outbox rows", |client| {
            let fences = fences.clone();
            Box::pin(async move { outbox::hand_back(client, &fences).await })
        })
        .await
        .unwrap_or(0);
        relay.metrics.deliveries(DeliveryOutcome::HandedBack, handed);
        tracing::info!(
            outcome = DeliveryOutcome::HandedBack.as_str(),
            rows = handed,
            "claimed outbox rows handed back at shutdown"
        );
        return;
    }
    relay.metrics.in_flight.inc_by(rows.len() as i64);
    let mut places = held.rows;
    let mut deliveries: futures_util::stream::FuturesUnordered<_> = rows
        .iter()
        .map(|row| async move {
            let started = Instant::now();
            let result = relay.destination.deliver(row).await;
            (row, result, started.elapsed())
        })
        .collect();
    let mut wave: Vec<Ended<'_>> = Vec::new();
    let mut deadline: Option<tokio::time::Instant> = None;
    // One timer for the whole batch, reset for each wave.
    let linger = tokio::time::sleep(WAVE_LINGER);
    tokio::pin!(linger);
    loop {
        let next = if deadline.is_none() {
            deliveries.next().await
        } else {
            tokio::select! {
                next = deliveries.next() => next,
                _ = &mut linger => None,
            }
        };
        let finished = match next {
            Some((row, result, elapsed)) => {
                relay.metrics.delivery_seconds.observe(elapsed.as_secs_f64());
                relay.metrics.in_flight.dec();
                // Delivered or failed: its place is free for the next claim (its mark comes with
                // its wave; its lease covers the wait).
                drop(places.split(1));
                wave.push(Ended { row, result, elapsed });
                if deadline.is_none() {
                    let at = tokio::time::Instant::now() + WAVE_LINGER;
                    linger.as_mut().reset(at);
                    deadline = Some(at);
                }
                deliveries.is_empty()
            }
            None => true,
        };
        if !wave.is_empty()
            && (finished
                || wave.len() >= WAVE_ROWS
                || deadline.is_some_and(|at| at <= tokio::time::Instant::now()))
        {
            finish_wave(relay, std::mem::take(&mut wave)).await;
            deadline = None;
        }
        if deliveries.is_empty() && wave.is_empty() {
            break;
        }
    }
}

/// A row whose delivery ended.
struct Ended<'a> {
    row: &'a OutboxClaimed,
    result: Result<(), Failure>,
    elapsed: Duration,
}

/// Marks the delivered rows of a wave published in one statement, records its failures in
/// another, and counts and logs each row's outcome.
async fn finish_wave(relay: &Relay, wave: Vec<Ended<'_>>) {
    let delivered: Vec<Fence> =
        wave.iter().filter(|e| e.result.is_ok()).map(|e| Fence::from(e.row)).collect();
    let failures: Vec<DeliveryFailure> = wave
        .iter()
        .filter_map(|e| {
            let failure = e.result.as_ref().err()?;
            Some(DeliveryFailure {
                fence: Fence::from(e.row),
                error: failure.error.clone(),
                backoff: relay.backoff.after(e.row.attempts),
                not_before: failure.retry_after.unwrap_or_default().min(relay.backoff.max),
                park: failure.park,
            })
        })
        .collect();
    let marked = if delivered.is_empty() {
        Some(Vec::new())
    } else {
        let (pooler, timeout) = (relay.pooler, relay.db_timeout / 2);
        with_retries(relay, "mark outbox rows published", |client| {
            let delivered = delivered.clone();
            Box::pin(async move { outbox::mark_published(client, pooler, &delivered, timeout).await })
        })
        .await
    };
    let recorded = if failures.is_empty() {
        Some(Vec::new())
    } else {
        let (max_attempts, timeout) = (relay.max_attempts, relay.db_timeout / 2);
        with_retries(relay, "record failed outbox deliveries", |client| {
            let failures = failures.clone();
            Box::pin(async move { outbox::record_failures(client, &failures, max_attempts, timeout).await })
        })
        .await
    };

    let now = SystemTime::now();
    for Ended { row, result, elapsed } in &wave {
        let span = tracing::info_span!(
            "outbox_row",
            outbox_id = row.id,
            aggregate_type = %row.aggregate_type,
            aggregate_id = %row.aggregate_id,
            event_type = %row.event_type,
            attempt = row.attempts,
            fencing_token = row.fencing_token,
        );
        let _entered = span.enter();
        let elapsed_ms = inbox_domain::telemetry::millis(*elapsed);
        match result {
            Ok(()) => {
                let outcome = match &marked {
                    Some(ids) if ids.contains(&row.id) => DeliveryOutcome::Delivered,
                    Some(_) => DeliveryOutcome::Superseded,
                    None => DeliveryOutcome::Unmarked,
                };
                relay.metrics.deliveries(outcome, 1);
                if outcome == DeliveryOutcome::Delivered {
                    let waited = now.duration_since(row.created_at).unwrap_or_default();
                    relay.metrics.commit_to_delivered_seconds.observe(waited.as_secs_f64());
                    tracing::info!(outcome = outcome.as_str(), elapsed_ms, "outbox row delivered");
                } else {
                    tracing::warn!(
                        outcome = outcome.as_str(),
                        elapsed_ms,
                        "outbox row delivered but not marked published: it is delivered again (same id)"
                    );
                }
            }
            Err(failure) => {
                let parked =
                    recorded.as_ref().and_then(|r| r.iter().find(|(id, _)| *id == row.id).map(|(_, p)| *p));
                let outcome =
                    if parked == Some(true) { DeliveryOutcome::Parked } else { DeliveryOutcome::Failed };
                relay.metrics.deliveries(outcome, 1);
                tracing::warn!(
                    outcome = outcome.as_str(),
                    error = %failure.error,
                    elapsed_ms,
                    recorded = parked.is_some(),
                    "outbox delivery failed"
                );
            }
        }
    }
}

/// A statement's future, borrowing its connection.
type WriteFuture<'c, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, tokio_postgres::Error>> + Send + 'c>>;

/// Runs `write` on a pooled connection (its statement cache included), trying up to three times
/// within about a second (a mark lost to a blip would mean delivering the batch again after its
/// lease); None when every try failed (said once).
async fn with_retries<T, F>(relay: &Relay, what: &str, write: F) -> Option<T>
where
    F: for<'c> Fn(&'c deadpool_postgres::Object) -> WriteFuture<'c, T>,
{
    let mut last = String::new();
    for delay in [Duration::ZERO, Duration::from_millis(200), Duration::from_millis(800)] {
        tokio::time::sleep(delay).await;
        let attempt = async {
            let mut conn = Conn::get(&relay.pool).await?;
            let value = write(conn.client()).await.map_err(|e| describe_db_error(&e))?;
            conn.set_clean(true);
            Ok::<T, String>(value)
        };
        match tokio::time::timeout(relay.db_timeout, attempt).await {
            Ok(Ok(value)) => {
                relay.outage.succeeded();
                return Some(value);
            }
            Ok(Err(e)) => last = e,
            Err(_) => last = format!("no answer within {:?}", relay.db_timeout),
        }
    }
    relay.outage.failed(what, &last);
    None
}
