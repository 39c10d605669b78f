//! Prometheus metrics of the relay, on an explicit registry, served on `--metrics-listen` as the
//! worker's are.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use deadpool_postgres::Pool;
use inbox_domain::db::{describe_db_error, describe_pool_error, discard, within, DatabaseConfig};
use inbox_domain::inbox::store::outbox;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::DeliveryOutcome;
use crate::metrics::{Heartbeat, GAUGE_INTERVAL};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeliveryLabel {
    destination: &'static str,
    outcome: &'static str,
}

/// Handles to every relay metric; cloning shares the series.
#[derive(Clone)]
pub struct RelayMetrics {
    registry: Arc<Registry>,
    /// `http` or `nats`: the `destination` label.
    destination: &'static str,
    deliveries: Family<DeliveryLabel, Counter>,
    /// One delivery attempt: request to answer (HTTP), publish to ack (JetStream).
    pub delivery_seconds: Histogram,
    /// From the outbox row's commit (`created_at`) to its published mark.
    pub commit_to_delivered_seconds: Histogram,
    pub claim_batch_size: Histogram,
    pub in_flight: Gauge,
    pub pending: Gauge,
    pub parked: Gauge,
    pub blocked_aggregates: Gauge,
    pub oldest_pending_age_seconds: Gauge<f64, AtomicU64>,
    /// What `/healthz` reports.
    pub heartbeat: Heartbeat,
}

impl RelayMetrics {
    pub fn new(destination: &'static str) -> Self {
        let mut registry = Registry::default();
        let deliveries = Family::<DeliveryLabel, Counter>::default();
        registry.register(
            "inbox_relay_deliveries",
            "Outbox rows finished by this relay, by destination and outcome (delivered, failed, parked, superseded, unmarked, handed_back)",
            deliveries.clone(),
        );
        let delivery_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        registry.register(
            "inbox_relay_delivery_seconds",
            "One delivery attempt: the HTTP request to its answer, or the JetStream publish to its ack",
            delivery_seconds.clone(),
        );
        let commit_to_delivered_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 24));
        registry.register(
            "inbox_relay_commit_to_delivered_seconds",
            "Time from the outbox row's commit (created_at) to its published mark",
            commit_to_delivered_seconds.clone(),
        );
        let claim_batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 11));
        registry.register(
            "inbox_relay_claim_batch_size",
            "Rows returned by each claim",
            claim_batch_size.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("inbox_relay_in_flight", "Deliveries in flight in this relay", in_flight.clone());
        let pending = Gauge::default();
        registry.register(
            "inbox_outbox_pending",
            "Outbox rows not yet delivered and not parked",
            pending.clone(),
        );
        let parked = Gauge::default();
        registry.register(
            "inbox_outbox_parked",
            "Outbox rows parked after their last allowed attempt, waiting for requeue --outbox",
            parked.clone(),
        );
        let blocked_aggregates = Gauge::default();
        registry.register(
            "inbox_outbox_blocked_aggregates",
            "Aggregates whose first undelivered outbox row is parked: their later rows wait behind it",
            blocked_aggregates.clone(),
        );
        let oldest_pending_age_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "inbox_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending outbox row (0 when none)",
            oldest_pending_age_seconds.clone(),
        );
        RelayMetrics {
            registry: Arc::new(registry),
            destination,
            deliveries,
            delivery_seconds,
            commit_to_delivered_seconds,
            claim_batch_size,
            in_flight,
            pending,
            parked,
            blocked_aggregates,
            oldest_pending_age_seconds,
            heartbeat: Heartbeat::new(),
        }
    }

    /// Counts `n` rows that ended with `outcome`.
    pub fn deliveries(&self, outcome: DeliveryOutcome, n: u64) {
        if n > 0 {
            self.deliveries
                .get_or_create(&DeliveryLabel { destination: self.destination, outcome: outcome.as_str() })
                .inc_by(n);
        }
    }

    pub fn render(&self) -> String {
        inbox_domain::telemetry::render_metrics(&self.registry)
    }
}

/// Refreshes the outbox gauges every [`GAUGE_INTERVAL`] until `stop`; a count that outlives the
/// interval is abandoned (its connection cancelled and discarded).
pub async fn refresh_gauges(
    pool: Pool,
    database: DatabaseConfig,
    metrics: RelayMetrics,
    stop: CancellationToken,
) {
    let stats = async |client: &mut deadpool_postgres::Object| outbox::stats(&***client).await;
    loop {
        match pool.get().await {
            Err(e) => {
                tracing::debug!(error = %describe_pool_error(&e), "refreshing outbox gauges: no connection")
            }
            Ok(client) => match within(client, Instant::now() + GAUGE_INTERVAL, &database, &stats).await {
                Some((_, Ok(s))) => {
                    metrics.pending.set(s.pending);
                    metrics.parked.set(s.parked);
                    metrics.blocked_aggregates.set(s.blocked_aggregates);
                    metrics.oldest_pending_age_seconds.set(s.oldest_pending_age_seconds.unwrap_or(0.0));
                }
                Some((client, Err(e))) => {
                    tracing::debug!(error = %describe_db_error(&e), "refreshing outbox gauges failed");
                    discard(client);
                }
                None => tracing::debug!("refreshing outbox gauges timed out: cancelled"),
            },
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(GAUGE_INTERVAL) => {}
        }
    }
}
