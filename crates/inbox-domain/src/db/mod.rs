//! Connections to PostgreSQL, as both binaries make them: the connection string with its TLS
//! settings ([`DatabaseConfig`]), pools, and error texts that name the cause.

pub mod tls;
pub mod url;

use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;

pub use url::{RootCerts, SslMode, TlsSettings};

/// What stands between the binaries and PostgreSQL (`--db-pooler`, `INBOX_DB_POOLER`).
///
/// Every statement of this project runs inside one transaction or is sent unnamed, and limits are
/// set per transaction, so a direct connection and a session-mode pool need nothing special. A
/// transaction-mode pool (PgBouncer's `pool_mode = transaction`) gives each transaction whatever
/// server connection is free: a statement prepared in one transaction is gone in the next (or is
/// another client's), notifications have nowhere to go, and a session's advisory lock ends with
/// its transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pooler {
    /// The server, or a pool that keeps a server connection per client session.
    #[default]
    None,
    /// A transaction-mode pool: the ingest's insert is sent unnamed instead of prepared once per
    /// connection, workers find new rows by polling (no LISTEN), and `migrate` is refused (its
    /// lock needs a session).
    Transaction,
}

impl std::str::FromStr for Pooler {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Pooler::None),
            "transaction" => Ok(Pooler::Transaction),
            _ => Err("expected `none` (the server or a session-mode pool) or `transaction`".to_owned()),
        }
    }
}

/// Where the database is and how to reach it: tokio-postgres' settings, the TLS settings, and the
/// connector built from them (certificate files are read when it is built, at start-up). Every
/// connection of every binary goes through [`DatabaseConfig::connector`].
#[derive(Clone)]
pub struct DatabaseConfig {
    /// Host, port, user, password, database, options… (its Debug output redacts the password).
    pub config: tokio_postgres::Config,
    pub tls: TlsSettings,
    /// A transaction-mode pool in between, or not.
    pub pooler: Pooler,
    connector: MakeRustlsConnect,
}

impl DatabaseConfig {
    /// `config` with `tls`; fails when a certificate file cannot be read or used.
    pub fn new(config: tokio_postgres::Config, tls: TlsSettings) -> anyhow::Result<Self> {
        let connector = tls::connector(&tls)?;
        Ok(DatabaseConfig { config, tls, pooler: Pooler::None, connector })
    }

    /// The TLS connector for tokio-postgres (used whatever the mode: with `disable` it never
    /// starts TLS).
    pub fn connector(&self) -> MakeRustlsConnect {
        self.connector.clone()
    }

    /// One connection, outside any pool (the worker's LISTEN connection, `migrate`), with the
    /// connection driven on the current runtime until the client is dropped.
    pub async fn connect(
        &self,
        application_name: &str,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let mut config = self.config.clone();
        config.application_name(application_name);
        let (client, connection) = config.connect(self.connector()).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("config", &self.config)
            .field("tls", &self.tls)
            .field("pooler", &self.pooler)
            .finish()
    }
}

/// A plain tokio-postgres configuration, its TLS as tokio-postgres understood it (`prefer` by
/// default): for tests and tools that build their configuration in code.
impl From<tokio_postgres::Config> for DatabaseConfig {
    fn from(config: tokio_postgres::Config) -> Self {
        use tokio_postgres::config::SslMode as Wire;
        let mode = match config.get_ssl_mode() {
            Wire::Disable => SslMode::Disable,
            Wire::Require => SslMode::Require,
            _ => SslMode::Prefer,
        };
        let tls = TlsSettings { mode, root_certs: None, client_cert: None };
        let connector = tls::connector(&tls).expect("a connector that verifies nothing reads no file");
        DatabaseConfig { config, tls, pooler: Pooler::None, connector }
    }
}

/// How a pool is sized and bounded.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Most connections open at once.
    pub max_size: usize,
    /// Bound on waiting for a free connection, on opening one and on recycling one.
    pub timeout: Duration,
    /// `application_name` shown in `pg_stat_activity`, so operators can tell the roles apart.
    pub application_name: &'static str,
    /// A `statement_timeout` for every statement of these sessions, set by a `SET` right after a
    /// connection opens — not as a startup option, so the user's `options` are kept and a pooler
    /// that refuses startup options is not involved. Only where a session is the caller's own:
    /// behind a transaction pooler a session setting would reach other clients' transactions, so
    /// there the callers set their limits per transaction and leave this None.
    pub session_statement_timeout: Option<Duration>,
    /// Run an empty query on every checkout (`Verified` recycling) instead of only checking that
    /// the connection is not known to be closed (`Fast`). Verified notices a connection the
    /// network dropped silently before it is used, at one round trip per checkout; callers that
    /// bound every use with their own deadline and discard a connection after any error can
    /// skip it.
    pub verify_on_checkout: bool,
}

/// Parses a `DATABASE_URL` (URL or key=value form, with libpq's TLS settings: see [`url`] and
/// [`tls`]) and reads the certificate files it names. The error never repeats the URL, which may
/// hold a password.
pub fn parse_database_url(url: &str) -> anyhow::Result<DatabaseConfig> {
    let (config, tls) = url::split(url)?;
    DatabaseConfig::new(config, tls)
}

/// Builds a pool. Connections are opened lazily; call [`check_reachable`] to fail fast at start-up.
/// Nothing is sent at connect beyond the user's settings (no `options` of ours: they would replace
/// the user's, and PgBouncer refuses them); see [`PoolOptions::session_statement_timeout`].
///
/// A connection the server closed (restart, `pg_terminate_backend`) is replaced at checkout, so
/// the service recovers by itself when the database returns; with `verify_on_checkout` also one
/// the network dropped without a word (see [`PoolOptions::verify_on_checkout`]).
pub fn build_pool(database: &DatabaseConfig, opts: &PoolOptions) -> anyhow::Result<Pool> {
    let mut pg = database.config.clone();
    pg.application_name(opts.application_name);
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(opts.timeout);
    }
    pg.keepalives(true);
    pg.keepalives_idle(Duration::from_secs(30));
    let recycling_method =
        if opts.verify_on_checkout { RecyclingMethod::Verified } else { RecyclingMethod::Fast };
    let manager = Manager::from_config(pg, database.connector(), ManagerConfig { recycling_method });
    let mut builder = Pool::builder(manager);
    if let Some(timeout) = opts.session_statement_timeout {
        let set = format!("SET statement_timeout = {}", timeout.as_millis().max(1));
        builder = builder.post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
            let set = set.clone();
            Box::pin(async move {
                client.batch_execute(&set).await.map_err(deadpool_postgres::HookError::Backend)
            })
        }));
    }
    builder
        .max_size(opts.max_size)
        .wait_timeout(Some(opts.timeout))
        .create_timeout(Some(opts.timeout))
        .recycle_timeout(Some(opts.timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .context("building the connection pool")
}

/// Gives up on a pooled connection whose statement outlived its caller's deadline: takes it out
/// of the pool (it is never handed to the next user with a query still running) and asks the
/// server to cancel what it runs (a dropped query future cancels nothing by itself).
pub fn abandon(client: deadpool_postgres::Object, database: &DatabaseConfig) {
    let token = client.cancel_token();
    let tls = database.connector();
    drop(deadpool_postgres::Object::take(client));
    tokio::spawn(async move {
        if let Err(e) = token.cancel_query(tls).await {
            tracing::debug!(error = %describe_db_error(&e), "cancel request failed");
        }
    });
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
    let hint = tls::hint(e);
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
    if let Some(hint) = hint {
        text.push_str(": ");
        text.push_str(hint);
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
