//! Prometheus metrics of the worker, on an explicit registry, served on `--metrics-listen`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpResponse, HttpServer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// How an event (or a claimed row) ended, as counted in `inbox_worker_events_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// Its handler's effect and the processed mark committed together.
    Processed,
    /// No handler for its type: marked processed with no effect.
    Ignored,
    /// Its attempt failed; it is retried after a backoff.
    Failed,
    /// Its attempt failed at the attempt limit: parked until an operator requeues it.
    Parked,
    /// Another worker processed it meanwhile (this worker's lease had expired): nothing done.
    AlreadyProcessed,
    /// Claimed but not started before shutdown: returned to the queue with its attempt.
    HandedBack,
    /// Its batch was interrupted by an infrastructure fault: returned to the queue with its
    /// attempt, retried within seconds.
    Interrupted,
}

impl EventOutcome {
    /// The metric label and log field value.
    pub fn as_str(self) -> &'static str {
        match self {
            EventOutcome::Processed => "processed",
            EventOutcome::Ignored => "ignored",
            EventOutcome::Failed => "failed",
            EventOutcome::Parked => "parked",
            EventOutcome::AlreadyProcessed => "already_processed",
            EventOutcome::HandedBack => "handed_back",
            EventOutcome::Interrupted => "interrupted",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabel {
    table: String,
}

/// The tables `inbox_worker_stats_reset_analyses_total` counts (its series exist from the start, at 0).
const ANALYSED_TABLES: [&str; 3] = ["webhook_inbox", "webhook_inbox_queue", "outbox"];

/// The processing runtime's pulse, for `/healthz`: the metrics server runs on a thread of its own,
/// so without it `/healthz` would answer 200 while a handler blocks the thread every claim, batch
/// and timeout runs on. A task on the processing runtime beats every [`HEARTBEAT_INTERVAL`]
/// ([`Heartbeat::run`]); `/healthz` answers 503 once no beat came for [`STALLED_AFTER`].
#[derive(Clone)]
pub struct Heartbeat {
    start: Instant,
    /// Milliseconds from `start` to the last beat.
    last: Arc<AtomicU64>,
}

/// How often the processing runtime beats.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// No beat for this long: `/healthz` says stalled. Well above the longest a healthy runtime goes
/// without polling a task (a claim or a batch awaits the database; it does not hold the thread).
pub const STALLED_AFTER: Duration = Duration::from_secs(10);

impl Heartbeat {
    pub fn new() -> Self {
        Heartbeat { start: Instant::now(), last: Arc::new(AtomicU64::new(0)) }
    }

    pub fn beat(&self) {
        self.last.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the last beat.
    pub fn silence(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// Beats every [`HEARTBEAT_INTERVAL`] until `stop`; spawn it on the processing runtime.
    pub async fn run(self, stop: tokio_util::sync::CancellationToken) {
        loop {
            self.beat();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(HEARTBEAT_INTERVAL) => {}
            }
        }
    }
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self::new()
    }
}

/// Handles to every worker metric; cloning shares the series.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    events: Family<OutcomeLabel, Counter>,
    pub processing_seconds: Histogram,
    pub receive_to_processed_seconds: Histogram,
    pub claim_batch_size: Histogram,
    pub claim_seconds: Histogram,
    pub in_flight: Gauge,
    pub unprocessed: Gauge,
    pub ready: Gauge,
    pub needs_review: Gauge,
    pub no_handler: Gauge,
    pub oldest_unprocessed_age_seconds: Gauge<f64, AtomicU64>,
    /// Open reconciliation items: counted by every worker itself (a cheap index count, see
    /// `store::reconciliation::open_count`), not shared through `queue_gauges`.
    pub reconciliation_items_open: Gauge,
    /// Analyses this worker ran because PostgreSQL's statistics of a queue table were reset (a
    /// crash restart): see `crate::statistics`.
    stats_reset_analyses: Family<TableLabel, Counter>,
    /// What `/healthz` reports.
    pub heartbeat: Heartbeat,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let events = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "inbox_worker_events",
            "Events finished by this worker, by outcome (processed, ignored, failed, parked, already_processed, handed_back, interrupted)",
            events.clone(),
        );
        let processing_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register(
            "inbox_worker_processing_seconds",
            "Time to run one process transaction: a batch of up to --batch-size events",
            processing_seconds.clone(),
        );
        let receive_to_processed_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        registry.register(
            "inbox_worker_receive_to_processed_seconds",
            "Time from the ingest's commit (received_at) to processed_at",
            receive_to_processed_seconds.clone(),
        );
        let claim_batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        registry.register(
            "inbox_worker_claim_batch_size",
            "Rows returned by each claim (up to --batch-size per free process transaction)",
            claim_batch_size.clone(),
        );
        let claim_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        registry.register(
            "inbox_worker_claim_seconds",
            "Time of each claim statement (the round trip that leases up to --batch-size rows per free process transaction), when it succeeded",
            claim_seconds.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "inbox_worker_in_flight",
            "Events being processed by this worker",
            in_flight.clone(),
        );
        let unprocessed = Gauge::default();
        registry.register(
            "inbox_unprocessed",
            "Inbox rows not yet processed (parked included)",
            unprocessed.clone(),
        );
        let ready = Gauge::default();
        registry.register("inbox_ready", "Inbox rows a live worker claims and may take now", ready.clone());
        let no_handler = Gauge::default();
        registry.register(
            "inbox_no_handler",
            "Inbox rows of event types no live worker handles or ignores: they wait, unclaimed",
            no_handler.clone(),
        );
        let needs_review = Gauge::default();
        registry.register(
            "inbox_needs_review",
            "Parked rows: attempts at the limit, waiting for requeue",
            needs_review.clone(),
        );
        let oldest_unprocessed_age_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "inbox_oldest_unprocessed_age_seconds",
            "Age of the oldest unprocessed row (0 when none)",
            oldest_unprocessed_age_seconds.clone(),
        );
        let reconciliation_items_open = Gauge::default();
        registry.register(
            "inbox_reconciliation_items_open",
            "Reconciliation items no person has resolved yet (inbox-worker reconciliation lists them)",
            reconciliation_items_open.clone(),
        );
        let stats_reset_analyses = Family::<TableLabel, Counter>::default();
        registry.register(
            "inbox_worker_stats_reset_analyses",
            "ANALYZEs this worker ran on webhook_inbox, webhook_inbox_queue or outbox because PostgreSQL had lost their statistics (crash recovery, a promoted replica, pg_stat_reset): autovacuum would otherwise not see the dead tuples made before",
            stats_reset_analyses.clone(),
        );
        for table in ANALYSED_TABLES {
            let _ = stats_reset_analyses.get_or_create(&TableLabel { table: table.to_owned() });
        }
        Metrics {
            registry: Arc::new(registry),
            events,
            processing_seconds,
            receive_to_processed_seconds,
            claim_batch_size,
            claim_seconds,
            in_flight,
            unprocessed,
            ready,
            needs_review,
            no_handler,
            oldest_unprocessed_age_seconds,
            reconciliation_items_open,
            stats_reset_analyses,
            heartbeat: Heartbeat::new(),
        }
    }

    /// Counts `n` events that ended with `outcome`.
    pub fn events(&self, outcome: EventOutcome, n: u64) {
        self.events.get_or_create(&OutcomeLabel { outcome: outcome.as_str() }).inc_by(n);
    }

    /// Counts one analyse of `table` after a statistics reset.
    pub fn count_stats_reset_analysis(&self, table: &str) {
        self.stats_reset_analyses.get_or_create(&TableLabel { table: table.to_owned() }).inc();
    }

    pub fn render(&self) -> String {
        inbox_domain::telemetry::render_metrics(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves `GET /metrics` and `GET /healthz` on `address` until the returned handle stops it.
/// `/healthz` is 200 while the processing runtime beats, 503 once it stalled (see [`Heartbeat`]).
/// `render` gives the metrics' text (the worker's, or the relay's).
pub fn serve<R>(
    address: SocketAddr,
    render: R,
    heartbeat: Heartbeat,
) -> anyhow::Result<(actix_web::dev::ServerHandle, SocketAddr)>
where
    R: Fn() -> String + Clone + Send + 'static,
{
    let listener = std::net::TcpListener::bind(address)?;
    let bound = listener.local_addr()?;
    let server = HttpServer::new(move || {
        let render = render.clone();
        let heartbeat = heartbeat.clone();
        App::new()
            .route(
                "/metrics",
                web::get().to(move || {
                    let body = render();
                    async move {
                        HttpResponse::Ok()
                            .content_type(inbox_domain::telemetry::METRICS_CONTENT_TYPE)
                            .body(body)
                    }
                }),
            )
            .route(
                "/healthz",
                web::get().to(move || {
                    let silence = heartbeat.silence();
                    async move {
                        if silence < STALLED_AFTER {
                            HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
                        } else {
                            HttpResponse::ServiceUnavailable().json(serde_json::json!({
                                "status": "stalled",
                                "error": format!(
                                    "the processing runtime has not run for {} s (a handler blocking its thread?)",
                                    silence.as_secs()
                                ),
                            }))
                        }
                    }
                }),
            )
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .listen(listener)?
    .run();
    let handle = server.handle();
    tokio::spawn(server);
    Ok((handle, bound))
}

/// How often the queue gauges are refreshed from the database.
pub const GAUGE_INTERVAL: Duration = Duration::from_secs(5);
