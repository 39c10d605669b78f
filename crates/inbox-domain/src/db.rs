//! The PostgreSQL connection pool both binaries use.

use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

/// How a pool is sized and bounded.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Most connections open at once.
    pub max_size: usize,
    /// Bound on waiting for a free connection, on opening one and on recycling one.
    pub timeout: Duration,
    /// `application_name` shown in `pg_stat_activity`, so operators can tell the roles apart.
    pub application_name: &'static str,
    /// Server-side `statement_timeout` for every statement of these sessions (None: server default).
    pub statement_timeout: Option<Duration>,
    /// Run an empty query on every checkout (`Verified` recycling) instead of only checking that
    /// the connection is not known to be closed (`Fast`). Verified notices a connection the
    /// network dropped silently before it is used, at one round trip per checkout; callers that
    /// bound every use with their own deadline and discard a connection after any error can
    /// skip it.
    pub verify_on_checkout: bool,
}

/// Parses a `DATABASE_URL` (URL or key=value form). The error never repeats the URL, which may
/// hold a password.
pub fn parse_database_url(url: &str) -> anyhow::Result<tokio_postgres::Config> {
    url.parse::<tokio_postgres::Config>()
        .map_err(|e| anyhow::anyhow!("DATABASE_URL is not a valid PostgreSQL connection string: {e}"))
}

/// Builds a pool. Connections are opened lazily; call [`check_reachable`] to fail fast at start-up.
///
/// A connection the server closed (restart, `pg_terminate_backend`) is replaced at checkout, so
/// the service recovers by itself when the database returns; with `verify_on_checkout` also one
/// the network dropped without a word (see [`PoolOptions::verify_on_checkout`]).
pub fn build_pool(mut pg: tokio_postgres::Config, opts: &PoolOptions) -> anyhow::Result<Pool> {
    pg.application_name(opts.application_name);
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(opts.timeout);
    }
    if let Some(st) = opts.statement_timeout {
        pg.options(format!("-c statement_timeout={}", st.as_millis()));
    }
    pg.keepalives(true);
    pg.keepalives_idle(Duration::from_secs(30));
    let recycling_method =
        if opts.verify_on_checkout { RecyclingMethod::Verified } else { RecyclingMethod::Fast };
    let manager = Manager::from_config(pg, NoTls, ManagerConfig { recycling_method });
    Pool::builder(manager)
        .max_size(opts.max_size)
        .wait_timeout(Some(opts.timeout))
        .create_timeout(Some(opts.timeout))
        .recycle_timeout(Some(opts.timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .context("building the connection pool")
}

/// Opens one connection and runs a trivial query: the start-up check that the database is there.
pub async fn check_reachable(pool: &Pool) -> anyhow::Result<()> {
    let client = pool
        .get()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", describe_pool_error(&e)))?;
    client
        .simple_query("SELECT 1")
        .await
        .map_err(|e| anyhow::anyhow!("the database does not answer: {}", describe_db_error(&e)))?;
    Ok(())
}

/// A database error as every message and log line reports it: the server's message with its
/// SQLSTATE, e.g. `canceling statement due to statement timeout (57014)`; for an error the server
/// did not send (a refused or closed connection, a TLS failure), the driver's text followed by its
/// causes, e.g. `error connecting to server: Connection refused (os error 111)`. tokio-postgres'
/// own `Display` of a server error is only "db error", and of an I/O error only its kind.
pub fn describe_db_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{} ({})", db.message(), db.code().code());
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A database error as an `anyhow` error saying what we were doing (see [`describe_db_error`]).
pub fn db_error(doing: &str, e: &tokio_postgres::Error) -> anyhow::Error {
    anyhow::anyhow!("{doing}: {}", describe_db_error(e))
}

/// A short description of a pool error that names the cause (refused, timed out, …) without
/// printing connection parameters.
pub fn describe_pool_error(e: &deadpool_postgres::PoolError) -> String {
    use deadpool_postgres::PoolError;
    match e {
        PoolError::Timeout(kind) => format!("timed out ({kind:?}) waiting for a database connection"),
        PoolError::Backend(e) => describe_db_error(e),
        PoolError::Closed => "the pool is closed".to_owned(),
        PoolError::NoRuntimeSpecified => "no runtime for pool timeouts".to_owned(),
        PoolError::PostCreateHook(e) => format!("connection set-up failed: {e}"),
    }
}
