//! Prometheus metrics of the ingest, on an explicit registry (no global state).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignatureLabels {
    endpoint: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SecretLabels {
    endpoint: String,
    /// The secret's fingerprint, never the secret.
    secret: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

/// The label used for requests to endpoints that are not configured, so that scanning random
/// names cannot grow the number of series.
pub const UNKNOWN_ENDPOINT_LABEL: &str = "_unknown";

/// Handles to every ingest metric. Cloning is cheap (the series are shared).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    requests: Family<RequestLabels, Counter>,
    duration: Family<OutcomeLabel, Histogram>,
    signature_failures: Family<SignatureLabels, Counter>,
    verified: Family<SecretLabels, Counter>,
    unstorable: Family<EndpointLabel, Counter>,
    last_stored: Family<EndpointLabel, Gauge<f64, AtomicU64>>,
    batch_size: Histogram,
    body_bytes_held: Gauge,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~8 s: commits take milliseconds, timeouts take seconds.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 15))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "inbox_ingest_requests",
            "Webhook requests by endpoint and outcome (accepted, duplicate, bad_signature, ...)",
            requests.clone(),
        );
        let duration =
            Family::<OutcomeLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "inbox_ingest_request_duration_seconds",
            "Time from the request's arrival to its answer, by outcome",
            duration.clone(),
        );
        let signature_failures = Family::<SignatureLabels, Counter>::default();
        registry.register(
            "inbox_ingest_signature_failures",
            "Requests refused by signature verification, by endpoint and reason",
            signature_failures.clone(),
        );
        let verified = Family::<SecretLabels, Counter>::default();
        registry.register(
            "inbox_ingest_verified",
            "Deliveries whose signature verified, by endpoint and the fingerprint of the secret that \
             verified them (an old secret at 0 for a day is safe to remove)",
            verified.clone(),
        );
        let unstorable = Family::<EndpointLabel, Counter>::default();
        registry.register(
            "inbox_ingest_unstorable",
            "Verified bodies PostgreSQL's jsonb refused: kept byte for byte and parked for a person",
            unstorable.clone(),
        );
        let last_stored = Family::<EndpointLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "inbox_ingest_last_stored_timestamp_seconds",
            "Unix time at which this process last stored a new event for the endpoint (accepted, held \
             or unstorable; not a duplicate); absent until its first since the process started",
            last_stored.clone(),
        );
        let batch_size =
            Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(1.0, 2.0, 9));
        registry.register(
            "inbox_ingest_batch_size",
            "Requests written by each group-commit INSERT",
            batch_size.clone(),
        );
        let body_bytes_held = Gauge::default();
        registry.register(
            "inbox_ingest_body_bytes_held",
            "Request-body bytes held now, from the first byte received until the batch is written \
             (at most --max-bytes-in-flight; at it, requests wait for room and then get 503)",
            body_bytes_held.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            body_bytes_held,
            requests,
            duration,
            signature_failures,
            verified,
            unstorable,
            last_stored,
            batch_size,
        }
    }

    /// Creates an endpoint's per-secret and unstorable series at 0, so that a rate over them is
    /// defined from the start and the first unstorable body is an increase an alert sees (a
    /// series born at 1 shows no increase to `increase()`).
    pub fn register_endpoint(&self, endpoint: &str, fingerprints: &[std::sync::Arc<str>]) {
        for fingerprint in fingerprints {
            let labels = SecretLabels { endpoint: endpoint.to_owned(), secret: fingerprint.to_string() };
            drop(self.verified.get_or_create(&labels));
        }
        drop(self.unstorable.get_or_create(&EndpointLabel { endpoint: endpoint.to_owned() }));
    }

    pub fn verified(&self, endpoint: &str, fingerprint: &str) {
        self.verified
            .get_or_create(&SecretLabels { endpoint: endpoint.to_owned(), secret: fingerprint.to_owned() })
            .inc();
    }

    pub fn unstorable(&self, endpoint: &str) {
        self.unstorable.get_or_create(&EndpointLabel { endpoint: endpoint.to_owned() }).inc();
    }

    /// Sets the endpoint's `inbox_ingest_last_stored_timestamp_seconds` to now: a row was newly
    /// stored for it. A duplicate does not count: the gauge answers "when did Stripe last send this
    /// endpoint an event we did not have?", which is what a disabled endpoint stops and what
    /// `reconcile --since` needs (the newest event the inbox holds from this endpoint). Stripe
    /// redelivering an event we already stored — retries of a slow answer, resends from the
    /// Dashboard — would keep the gauge moving while no new event arrives. Not registered at
    /// start, unlike the counters: a time the endpoint never stored would read as 1970, and the
    /// alert takes the series' maximum over days, which an ingest restart (the gauge absent until
    /// its next event) does not lower.
    pub fn stored(&self, endpoint: &str) {
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        self.last_stored
            .get_or_create(&EndpointLabel { endpoint: endpoint.to_owned() })
            .set(now.as_secs_f64());
    }

    pub fn record(&self, endpoint: &str, outcome: &'static str, elapsed: Duration) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.to_owned(), outcome }).inc();
        self.duration.get_or_create(&OutcomeLabel { outcome }).observe(elapsed.as_secs_f64());
    }

    pub fn batch(&self, size: usize) {
        self.batch_size.observe(size as f64);
    }

    pub fn signature_failure(&self, endpoint: &str, reason: &'static str) {
        self.signature_failures
            .get_or_create(&SignatureLabels { endpoint: endpoint.to_owned(), reason })
            .inc();
    }

    /// Sets the request-body bytes held now (read when rendering).
    pub fn body_bytes_held(&self, bytes: u64) {
        self.body_bytes_held.set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The exposition text (OpenMetrics, which Prometheus scrapes natively).
    pub fn render(&self) -> String {
        inbox_domain::telemetry::render_metrics(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
