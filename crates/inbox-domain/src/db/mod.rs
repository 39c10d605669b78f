//! Connections to PostgreSQL, as both binaries make them: the connection string with its TLS
//! settings ([`DatabaseConfig`]), pools, and error texts that name the cause.

pub mod conninfo;
pub mod tls;

use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;

pub use conninfo::{PasswordSource, RootCerts, SslMode, TlsSettings};

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

/// Where the database is and how to reach it: tokio-postgres' settings, the TLS settings and the
/// connector built from them (certificate files are read when it is built, at start-up), and where
/// a new connection's password comes from. Every connection of every binary is opened by
/// [`DatabaseConfig::open`] or a pool built by [`build_pool`], which read a password file again
/// for each.
#[derive(Clone)]
pub struct DatabaseConfig {
    /// Host, port, user, database, options…, and the password when it is fixed (its Debug output
    /// redacts it).
    pub config: tokio_postgres::Config,
    pub tls: TlsSettings,
    /// A password read for every new connection (a rotated file, a pgpass file), or none.
    pub password: PasswordSource,
    /// A transaction-mode pool in between, or not.
    pub pooler: Pooler,
    /// Whether the user named the `application_name` (then each component's own name is not put
    /// in its place).
    application_name_given: bool,
    /// Whether the user set `keepalives` or `keepalives_idle` (then the pools' own are not put in
    /// their place).
    keepalives_given: bool,
    /// The last password read from the password file: used when a later read fails (a file being
    /// replaced), so one bad read does not stop every new connection.
    last_password: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    connector: MakeRustlsConnect,
}

impl DatabaseConfig {
    /// `config` with `tls`; fails when a certificate file cannot be read or used.
    pub fn new(config: tokio_postgres::Config, tls: TlsSettings) -> anyhow::Result<Self> {
        let connector = tls::connector(&tls)?;
        Ok(DatabaseConfig {
            config,
            tls,
            password: PasswordSource::Fixed,
            pooler: Pooler::None,
            application_name_given: false,
            keepalives_given: false,
            last_password: Default::default(),
            connector,
        })
    }

    /// The TLS connector for tokio-postgres (used whatever the mode: with `disable` it never
    /// starts TLS).
    pub fn connector(&self) -> MakeRustlsConnect {
        self.connector.clone()
    }

    /// Names the connections of a component (`pg_stat_activity.application_name`) unless the user
    /// named them (libpq's `fallback_application_name`).
    pub fn name_connections(&mut self, application_name: &str) {
        if !self.application_name_given {
            self.config.application_name(application_name);
        }
    }

    /// The settings for one new connection: `config` with the password read now when it comes
    /// from a file. A password file that cannot be read now is logged and its last password used.
    pub fn settings_for_new_connection(&self, config: &tokio_postgres::Config) -> tokio_postgres::Config {
        let mut config = config.clone();
        match &self.password {
            PasswordSource::Fixed => {}
            PasswordSource::File(path) => {
                let mut last = self.last_password.lock().unwrap_or_else(|e| e.into_inner());
                match conninfo::read_password_file(path) {
                    Ok(password) => *last = Some(password),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the password file: using the password read before")
                    }
                }
                if let Some(password) = last.as_ref() {
                    config.password(password.as_bytes());
                }
            }
            PasswordSource::Pgpass(path) => {
                let user = config.get_user().unwrap_or_default().to_owned();
                let dbname = config.get_dbname().unwrap_or_default().to_owned();
                let ports = config.get_ports().to_vec();
                let found = config.get_hosts().iter().enumerate().find_map(|(i, host)| {
                    let host = match host {
                        tokio_postgres::config::Host::Tcp(name) => name.clone(),
                        tokio_postgres::config::Host::Unix(_) => String::new(),
                    };
                    let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                    conninfo::pgpass_lookup(path, &host, port, &dbname, &user)
                });
                if let Some(password) = found {
                    config.password(password);
                }
            }
        }
        config
    }

    /// Where connections go, for messages: hosts and ports (`db.example.com:5432`, a socket
    /// directory, `host (hostaddr)`), the user and the database — never the password.
    pub fn target(&self) -> String {
        let ports = self.config.get_ports();
        let addrs = self.config.get_hostaddrs();
        let mut places: Vec<String> = self
            .config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let host = match host {
                    tokio_postgres::config::Host::Tcp(name) => name.clone(),
                    tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
                };
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match addrs.get(i) {
                    Some(addr) => format!("{host} ({addr}):{port}"),
                    None => format!("{host}:{port}"),
                }
            })
            .collect();
        if places.is_empty() {
            places = addrs
                .iter()
                .enumerate()
                .map(|(i, addr)| {
                    format!("{addr}:{}", ports.get(i).or(ports.first()).copied().unwrap_or(5432))
                })
                .collect();
        }
        format!(
            "{} (user {}, database {})",
            places.join(", "),
            self.config.get_user().unwrap_or("?"),
            self.config.get_dbname().unwrap_or("?")
        )
    }

    /// The error of a connection that could not be made, whatever made it (a pool, [`Self::open`]):
    /// where it tried and the reason, so that every command says it the same way.
    pub fn unreachable(&self, reason: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("cannot connect to the database at {}: {reason}", self.target())
    }

    /// One connection, outside any pool (the worker's LISTEN connection, `migrate`), with its
    /// `Connection` to drive.
    pub async fn open(
        &self,
        application_name: &str,
    ) -> Result<(tokio_postgres::Client, Connection), tokio_postgres::Error> {
        let mut named = self.clone();
        named.name_connections(application_name);
        named.settings_for_new_connection(&named.config).connect(self.connector()).await
    }

    /// One connection, outside any pool, driven on the current runtime until the client is dropped.
    pub async fn connect(
        &self,
        application_name: &str,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, connection) = self.open(application_name).await?;
        tokio::spawn(connection);
        Ok(client)
    }
}

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("config", &self.config)
            .field("tls", &self.tls)
            .field("password", &self.password)
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
        DatabaseConfig::new(config, tls).expect("a connector that verifies nothing reads no file")
    }
}

/// Opens pooled connections as [`DatabaseConfig::open`] does: the password read for each.
struct PoolConnector(DatabaseConfig);

impl deadpool_postgres::Connect for PoolConnector {
    fn connect(
        &self,
        pg_config: &tokio_postgres::Config,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<
                        (tokio_postgres::Client, tokio::task::JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        let config = self.0.settings_for_new_connection(pg_config);
        let tls = self.0.connector();
        Box::pin(async move {
            let (client, connection) = config.connect(tls).await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %describe_db_error(&e), "database connection closed");
                }
            });
            Ok((client, driver))
        })
    }
}

/// A connection's I/O half, as [`DatabaseConfig::open`] returns it: poll it (or spawn it) to drive
/// the client.
pub type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>>::Stream,
>;

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
    /// Run [`crate::inbox::store::SESSION_WRITE_BACK_SQL`] right after a connection opens, so
    /// that every write of the session asks the kernel for write-back, those outside the
    /// transactions that set their limits too (the ingest's autocommit insert). Why the pipeline
    /// asks for it is in that statement's doc. Same condition as `session_statement_timeout`: the
    /// session must be the caller's own.
    pub session_write_back: bool,
    /// Run an empty query on every checkout (`Verified` recycling) instead of only checking that
    /// the connection is not known to be closed (`Fast`). Verified notices a connection the
    /// network dropped silently before it is used, at one round trip per checkout; callers that
    /// bound every use with their own deadline and discard a connection after any error can
    /// skip it.
    pub verify_on_checkout: bool,
}

/// Parses a `DATABASE_URL` (URL or key=value form) as libpq does, the `PG*` environment and
/// `DATABASE_PASSWORD_FILE` filling what it leaves out (see [`conninfo`]), and reads the
/// certificate files it names ([`tls`]). The error never repeats the string, which may hold a
/// password; warnings (an insecure pgpass file ignored) are logged.
pub fn parse_database_url(url: &str) -> anyhow::Result<DatabaseConfig> {
    let info = conninfo::resolve(url, &conninfo::ProcessEnvironment)?;
    for warning in &info.warnings {
        tracing::warn!("{warning}");
    }
    let mut database = DatabaseConfig::new(info.config, info.tls)?;
    database.password = info.password;
    database.application_name_given = info.application_name_given;
    database.keepalives_given = info.keepalives_given;
    Ok(database)
}

/// Builds a pool. Connections are opened lazily; call [`check_reachable`] to fail fast at start-up.
/// Nothing is sent at connect beyond the user's settings (no `options` of ours: they would replace
/// the user's, and PgBouncer refuses them); see [`PoolOptions::session_statement_timeout`].
///
/// A connection the server closed (restart, `pg_terminate_backend`) is replaced at checkout, so
/// the service recovers by itself when the database returns; with `verify_on_checkout` also one
/// the network dropped without a word (see [`PoolOptions::verify_on_checkout`]).
pub fn build_pool(database: &DatabaseConfig, opts: &PoolOptions) -> anyhow::Result<Pool> {
    let mut database = database.clone();
    database.name_connections(opts.application_name);
    let mut pg = database.config.clone();
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(opts.timeout);
    }
    if !database.keepalives_given {
        pg.keepalives(true);
        pg.keepalives_idle(Duration::from_secs(30));
    }
    let recycling_method =
        if opts.verify_on_checkout { RecyclingMethod::Verified } else { RecyclingMethod::Fast };
    let manager = Manager::from_connect(pg, PoolConnector(database), ManagerConfig { recycling_method });
    let mut builder = Pool::builder(manager);
    let mut session = Vec::new();
    if let Some(timeout) = opts.session_statement_timeout {
        session.push(format!("SET statement_timeout = {}", timeout.as_millis().max(1)));
    }
    if opts.session_write_back {
        session.push(crate::inbox::store::SESSION_WRITE_BACK_SQL.to_owned());
    }
    if !session.is_empty() {
        let set = session.join("; ");
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

/// Runs `statement` on a pooled connection until `deadline`. Its outcome comes back with the
/// connection, for the caller to return to the pool (drop it) or discard; a statement with no
/// answer by then gives `None`, and its connection is taken out of the pool and its statement
/// cancelled. The way every caller holding a connection of its own gives it up at a deadline, so
/// that none hands the pool a connection with a statement still running, or waits on one the
/// network dropped without a word. A connection several statements share at once (the ingest's
/// batches) cannot be handed over by one of them: its holder [`cancel`]s the statement and
/// [`discard`]s the connection when the last of them lets go.
pub async fn within<T>(
    mut client: deadpool_postgres::Object,
    deadline: tokio::time::Instant,
    database: &DatabaseConfig,
    statement: impl AsyncFnOnce(&mut deadpool_postgres::Object) -> T,
) -> Option<(deadpool_postgres::Object, T)> {
    let answer = tokio::time::timeout_at(deadline, statement(&mut client)).await;
    match answer {
        Ok(outcome) => Some((client, outcome)),
        Err(_) => {
            abandon(client, database);
            None
        }
    }
}

/// Takes a pooled connection out of the pool and closes it, instead of handing it to the next
/// user: for a connection whose statement failed in a way that may have left it unusable, or in an
/// unknown transaction state. The server ends its session and rolls back whatever was open.
pub fn discard(client: deadpool_postgres::Object) {
    drop(deadpool_postgres::Object::take(client));
}

/// Gives up on a pooled connection whose statement outlived its caller's deadline: takes it out
/// of the pool (it is never handed to the next user with a query still running) and asks the
/// server to cancel what it runs (a dropped query future cancels nothing by itself).
fn abandon(client: deadpool_postgres::Object, database: &DatabaseConfig) {
    let token = client.cancel_token();
    discard(client);
    cancel(token, database);
}

/// Asks the server to cancel whatever statement `token`'s session is running now, in the
/// background: a dropped query future cancels nothing by itself.
pub fn cancel(token: tokio_postgres::CancelToken, database: &DatabaseConfig) {
    let tls = database.connector();
    tokio::spawn(async move {
        if let Err(e) = token.cancel_query(tls).await {
            tracing::debug!(error = %describe_db_error(&e), "cancel request failed");
        }
    });
}

/// Opens one connection and runs a trivial query: the start-up check that the database is there.
/// The error names where it tried (`database`'s [`DatabaseConfig::target`]).
pub async fn check_reachable(pool: &Pool, database: &DatabaseConfig) -> anyhow::Result<()> {
    let client = pool.get().await.map_err(|e| database.unreachable(describe_pool_error(&e)))?;
    client.simple_query("SELECT 1").await.map_err(|e| {
        anyhow::anyhow!("the database at {} does not answer: {}", database.target(), describe_db_error(&e))
    })?;
    Ok(())
}

/// One line when the database starts failing and one when it answers again, instead of a line per
/// failed call: an outage of a minute under load is thousands of calls. The failures in between
/// are counted, and said at debug level.
#[derive(Debug, Default)]
pub struct OutageLog {
    /// Where the database is ([`DatabaseConfig::target`]), named in the lines.
    target: String,
    /// Since when, and how many calls failed, while the outage lasts.
    state: std::sync::Mutex<Option<(std::time::Instant, u64)>>,
}

impl OutageLog {
    /// An outage log for the database at `target` (see [`DatabaseConfig::target`]).
    pub fn new(target: String) -> Self {
        OutageLog { target, state: Default::default() }
    }

    /// A call failed with `error` (the server's SQLSTATE and message, or the connection's fault)
    /// while doing `what`: logged at warn when it starts an outage, at debug otherwise.
    pub fn failed(&self, what: &str, error: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.as_mut() {
            None => {
                *state = Some((std::time::Instant::now(), 1));
                tracing::warn!(
                    error,
                    database = self.target,
                    "{what} failed: the database is failing (one line until it answers again)"
                );
            }
            Some((_, failures)) => {
                *failures += 1;
                tracing::debug!(error, "{what} failed");
            }
        }
    }

    /// A call succeeded: ends an outage, saying how long it lasted and how many calls failed.
    pub fn succeeded(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((since, failures)) = state.take() {
            tracing::info!(
                failed_calls = failures,
                outage_s = (since.elapsed().as_secs_f64() * 10.0).round() / 10.0,
                database = self.target,
                "the database answers again (reconnected)"
            );
        }
    }
}

/// A database error as every message and log line reports it: the server's message with its
/// SQLSTATE, e.g. `canceling statement due to statement timeout (57014)`; for an error the server
/// did not send (a refused or closed connection, a TLS failure), the driver's text followed by its
/// causes, e.g. `error connecting to server: Connection refused (os error 111)`. tokio-postgres'
/// own `Display` of a server error is only "db error", and of an I/O error only its kind.
///
/// An error that shows the settings are wrong for what is between us and the server names the
/// setting that fixes it ([`misconfiguration`]).
pub fn describe_db_error(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return match misconfiguration(e) {
            Some(fix) => format!("{} ({}): {fix}", db.message(), db.code().code()),
            None => format!("{} ({})", db.message(), db.code().code()),
        };
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

/// What [`misconfiguration`] says of a prepared statement gone between transactions.
pub const POOLER_FIX: &str = "prepared statements do not survive from one transaction to the next: a \
     transaction-mode pool (PgBouncer's pool_mode = transaction) is in between; set \
     INBOX_DB_POOLER=transaction (--db-pooler transaction)";

/// The setting that fixes `e`, when `e` shows the settings are wrong rather than the database
/// unwell: a statement this connection prepared is gone (26000) or another client's is in its
/// place (42P05) — a transaction-mode pool hands each transaction whatever server connection is
/// free, and this process was not told ([`Pooler::Transaction`]). Retrying never helps; callers
/// log it at error level and report it where an operator looks (the ingest's `/readyz`).
pub fn misconfiguration(e: &tokio_postgres::Error) -> Option<&'static str> {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(code)
            if *code == SqlState::INVALID_SQL_STATEMENT_NAME || *code == SqlState::DUPLICATE_PSTATEMENT =>
        {
            Some(POOLER_FIX)
        }
        _ => None,
    }
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
