//! Building and running the HTTP service.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
pub use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};
use anyhow::Context as _;
use deadpool_postgres::Pool;
use inbox_domain::budget::ByteBudget;
use inbox_domain::config::EndpointMode;
use inbox_domain::db::{build_pool, check_reachable, DatabaseConfig, OutageLog, PoolOptions, Pooler};
use inbox_domain::inbox::signature::Verifier;
use tokio::sync::Notify;

use crate::batcher::{Batcher, Target};
use crate::configuration::{ConnectionLimits, Settings};
use crate::error::IngestError;
use crate::log_limit::LogLimit;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::routes;
use crate::sources::SourcePolicy;

/// A configured endpoint, as requests meet it.
pub struct Endpoint {
    pub verifier: Verifier,
    /// The mode it serves when declared; an event of the other mode is parked on arrival.
    pub mode: Option<EndpointMode>,
    /// Fingerprint of each secret, in order: recorded on the rows and in the metrics.
    pub fingerprints: Vec<Arc<str>>,
}

/// What every request handler shares.
pub struct AppState {
    /// Each configured endpoint by name; a name not in here is a 404.
    pub endpoints: Arc<HashMap<String, Endpoint>>,
    /// Connections to the inbox database.
    pub pool: Pool,
    /// How to reach the database: what a cancel request for an abandoned query needs.
    pub database: inbox_domain::db::DatabaseConfig,
    /// Largest body accepted (413 above).
    pub max_body: usize,
    /// Bound on receiving the body (408 past it).
    pub body_timeout: Duration,
    /// Slowest average rate of a body after its first second (408 behind it), bytes per second.
    pub min_body_rate: u64,
    /// Who may deliver webhooks (403 otherwise).
    pub sources: SourcePolicy,
    /// Bound on storing the event, and on waiting for room for a body (503 past either).
    pub db_timeout: Duration,
    /// Request-body bytes held, from the first byte received until the batch is written
    /// (`--max-bytes-in-flight`): a body takes room as its bytes arrive.
    pub bodies: ByteBudget,
    pub metrics: Metrics,
    /// Group-commit writers: every insert goes through them.
    pub batcher: Batcher,
    /// Raised after each new row; the notifier turns bursts of it into one NOTIFY.
    pub wake_workers: Arc<Notify>,
    /// `/readyz`'s cached answer, and a misconfiguration the writers met.
    pub readiness: Arc<Readiness>,
    /// How many refused requests are logged (all are counted).
    pub refusal_log: LogLimit,
    /// How many requests for endpoints not configured are logged: apart, so that a scan of
    /// made-up names does not use up the lines of the other refusals.
    pub unknown_endpoint_log: LogLimit,
    /// The configured endpoints' names, sorted, for the line that logs an unknown one.
    pub endpoint_names: String,
}

/// Shortest gap between two NOTIFYs from one ingest process. A NOTIFY inside every insert
/// transaction would take PostgreSQL's global notify lock at each commit and serialise them;
/// instead one separate NOTIFY covers every row committed since the previous one.
///
/// Under steady load a row waits up to this long for the wake-up of the claim that takes it, so
/// it is most of receive→processed's median; a shorter gap means more, smaller batches, which
/// cost PostgreSQL more per event — little at half the ingest's maximum, much more at low rates
/// and under a held snapshot. 20, 10, 5 and 2 ms measured side by side, and a 30-minute soak at
/// 10 ms: docs/performance.md, "End to end at half the ingest's rate".
pub const NOTIFY_INTERVAL: Duration = Duration::from_millis(10);

/// Sends the coalesced wake-up NOTIFY until aborted. A NOTIFY with no answer within `timeout`
/// gives its connection up ([`inbox_domain::db::within`]), as a batch does: this task would otherwise
/// wait on a connection the network dropped silently, and the workers fall back to polling.
async fn notify_workers(pool: Pool, database: DatabaseConfig, timeout: Duration, wake: Arc<Notify>) {
    loop {
        wake.notified().await;
        if let Ok(client) = pool.get().await {
            let deadline = tokio::time::Instant::now() + timeout;
            let notify = async |client: &mut deadpool_postgres::Object| {
                client.batch_execute(inbox_domain::inbox::store::ingest::NOTIFY_SQL).await
            };
            match inbox_domain::db::within(client, deadline, &database, notify).await {
                Some((_, Ok(()))) => {}
                Some((_, Err(e))) => tracing::debug!(
                    error = %inbox_domain::db::describe_db_error(&e),
                    "wake-up NOTIFY failed (workers fall back to polling)"
                ),
                None => tracing::debug!("wake-up NOTIFY got no answer in time: its connection is given up"),
            }
        }
        tokio::time::sleep(NOTIFY_INTERVAL).await;
    }
}

/// A built service, bound to its listener, ready to run.
pub struct Application {
    port: u16,
    server: Server,
    pool: Pool,
    notifier: tokio::task::JoinHandle<()>,
}

/// How long in-flight requests may take to finish after a stop signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Bound on receiving a request's head (request line and headers), then 408 and the connection is
/// closed. Stripe sends its head at once; a sender trickling one holds a connection (and up to the
/// 128 KiB the HTTP layer buffers for a head) no longer than this.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// After an answer given without reading the whole body (413, 400 before the body, 503 for want of
/// room): the rest of the body is read and thrown away for this long, so that the sender sees the
/// answer rather than a reset, then the connection is closed.
pub const LINGER: Duration = Duration::from_secs(1);

/// An idle keep-alive connection is closed after this: it holds one of `--max-connections`.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);

impl Application {
    /// Builds the service on an already-bound listener (tests bind port 0), with the default
    /// [`ConnectionLimits`]. Refuses bad secrets or tolerance and an unreachable database.
    pub async fn build(settings: Settings, listener: TcpListener) -> anyhow::Result<Application> {
        Self::build_with(settings, ConnectionLimits::default(), listener).await
    }

    /// [`Application::build`] with the given connection limits.
    pub async fn build_with(
        settings: Settings,
        limits: ConnectionLimits,
        listener: TcpListener,
    ) -> anyhow::Result<Application> {
        let metrics = Metrics::new();
        for warning in inbox_domain::config::secret_warnings(&settings.endpoints) {
            tracing::warn!("{warning}");
        }
        let mut endpoints = HashMap::new();
        for spec in &settings.endpoints {
            let verifier = Verifier::new(&spec.secrets, settings.tolerance)
                .with_context(|| format!("endpoint {:?}", spec.name))?;
            let fingerprints: Vec<Arc<str>> =
                verifier.fingerprints().iter().map(|f| Arc::from(f.as_str())).collect();
            metrics.register_endpoint(&spec.name, &fingerprints);
            // What an operator matches `stats` and the metrics against during a secret roll.
            tracing::info!(
                endpoint = spec.name,
                secrets = ?fingerprints,
                mode = spec.mode.map_or("any", EndpointMode::as_str),
                "endpoint configured (secrets by fingerprint)"
            );
            endpoints.insert(spec.name.clone(), Endpoint { verifier, mode: spec.mode, fingerprints });
        }
        let pool = build_pool(
            &settings.database,
            &PoolOptions {
                max_size: settings.pool_size,
                timeout: settings.db_timeout,
                application_name: "inbox-ingest",
                // Directly, a timeout per session (free); behind a transaction pooler the insert
                // sets it per transaction instead (see store::ingest::insert_events).
                session_statement_timeout: (settings.database.pooler == Pooler::None)
                    .then_some(settings.db_timeout),
                // The same way: per session directly, with the limits behind a pooler.
                session_write_back: settings.database.pooler == Pooler::None,
                // Every use has a deadline and gives up on a connection that misses it (see
                // crate::batcher::checkout): a verification query per checkout would cost each
                // batch a round trip.
                verify_on_checkout: false,
            },
        )?;
        check_reachable(&pool, &settings.database).await?;
        // An older schema is not a refusal here: during a deploy the ingest may start before the
        // migration, and /readyz keeps it out of rotation until then. It is said at once, though.
        if let Ok(client) = pool.get().await {
            match inbox_domain::inbox::schema::state(&client).await {
                Ok(state @ inbox_domain::inbox::schema::SchemaState::Older { .. }) => {
                    tracing::error!(
                        "{} (/readyz answers 503 until then)",
                        state.message().unwrap_or_default()
                    )
                }
                Ok(state) => {
                    if let Some(message) = state.message() {
                        tracing::warn!("{message}");
                    }
                }
                Err(e) => tracing::warn!(error = format!("{e:#}"), "reading the schema version"),
            }
        }

        let port = listener.local_addr().context("reading the listener's address")?.port();
        // Leave a couple of connections for readiness checks and the wake-up NOTIFY.
        let writers = settings.pool_size.saturating_sub(2).max(1);
        let readiness = Arc::new(Readiness::default());
        let target = Target {
            pool: pool.clone(),
            pooler: settings.database.pooler,
            database: settings.database.clone(),
            timeout: settings.db_timeout,
            keep_raw: settings.keep_raw,
            readiness: readiness.clone(),
            outage: Arc::new(OutageLog::new(settings.database.target())),
        };
        let batcher = Batcher::start(target, writers, metrics.clone());
        let wake_workers = Arc::new(Notify::new());
        let notifier = tokio::spawn(notify_workers(
            pool.clone(),
            settings.database.clone(),
            settings.db_timeout,
            wake_workers.clone(),
        ));
        let mut names: Vec<&str> = settings.endpoints.iter().map(|e| e.name.as_str()).collect();
        names.sort_unstable();
        let endpoint_names = names.join(", ");
        let state = web::Data::new(AppState {
            wake_workers,
            endpoints: Arc::new(endpoints),
            pool: pool.clone(),
            database: settings.database.clone(),
            max_body: settings.max_body,
            body_timeout: settings.body_timeout,
            min_body_rate: settings.min_body_rate,
            sources: settings.sources.clone(),
            db_timeout: settings.db_timeout,
            bodies: ByteBudget::new(settings.max_bytes_in_flight),
            metrics,
            batcher,
            readiness,
            refusal_log: LogLimit::default(),
            unknown_endpoint_log: LogLimit::default(),
            endpoint_names,
        });
        // actix limits connections per server thread: split the limit between them (and use no
        // more threads than connections allowed).
        let threads = std::thread::available_parallelism()
            .map_or(2, std::num::NonZeroUsize::get)
            .clamp(1, 512)
            .min(limits.max_connections.max(1));
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(state.clone())
                .app_data(
                    web::PathConfig::default().error_handler(|_, _| IngestError::UnknownEndpoint.into()),
                )
                .service(
                    web::resource("/webhooks/stripe/{endpoint}")
                        .route(web::post().to(routes::receive_webhook)),
                )
                .route("/healthz", web::get().to(routes::healthz))
                .route("/readyz", web::get().to(routes::readyz))
                .route("/metrics", web::get().to(routes::metrics))
                .default_service(web::to(|| async {
                    HttpResponse::NotFound().json(serde_json::json!({ "error": "not found" }))
                }))
        })
        .workers(threads)
        .max_connections(limits.max_connections.max(1).div_ceil(threads))
        .client_request_timeout(HEAD_TIMEOUT)
        .client_disconnect_timeout(LINGER)
        .keep_alive(KEEP_ALIVE)
        .shutdown_timeout(SHUTDOWN_GRACE.as_secs())
        .listen(listener)
        .context("listening")?;
        if !settings.handle_signals {
            server = server.disable_signals();
        }
        Ok(Application { port, server: server.run(), pool, notifier })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A handle that stops the server gracefully (`stop(true)`) from elsewhere.
    pub fn handle(&self) -> ServerHandle {
        self.server.handle()
    }

    /// Serves until a stop signal (SIGTERM/SIGINT) or [`Application::handle`] stops it, after
    /// in-flight requests were answered.
    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        let result = self.server.await;
        self.notifier.abort();
        self.pool.close();
        result
    }
}
