//! `inbox-ingest`'s command line and environment, and the validated settings built from them.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use inbox_domain::config::{
    apply_endpoint_modes, load_endpoints, parse_byte_size, parse_duration, EndpointSpec,
};
use inbox_domain::db::{DatabaseConfig, Pooler};
use inbox_domain::telemetry::LogFormat;

use crate::sources::{parse_network, SourcePolicy};

/// Receives Stripe webhooks: verifies each signature on the raw body and commits the event to the
/// inbox before answering 2xx.
#[derive(Debug, Parser)]
#[command(name = "inbox-ingest", version, about, max_term_width = 100)]
pub struct Cli {
    /// PostgreSQL connection string (URL or key=value).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,

    /// Address to listen on (host:port).
    #[arg(long, env = "INBOX_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,

    /// A webhook endpoint and its signing secrets, NAME=SECRET[,SECRET…] (repeatable). The
    /// environment form separates endpoints with `;`.
    #[arg(
        long = "endpoint",
        value_name = "NAME=SECRET[,SECRET…]",
        env = "INBOX_ENDPOINTS",
        value_delimiter = ';',
        hide_env_values = true
    )]
    pub endpoints: Vec<String>,

    /// File with endpoints in the INBOX_ENDPOINTS format (`;` or newlines between entries), for
    /// secrets mounted as files.
    #[arg(long, env = "INBOX_ENDPOINTS_FILE", value_name = "PATH")]
    pub endpoints_file: Option<PathBuf>,

    /// Declares which of Stripe's modes an endpoint serves, NAME=live|test (repeatable; the
    /// environment form separates entries with `;`). An event whose `livemode` disagrees is stored
    /// and parked for a person, never applied. Endpoints not named apply events of both modes.
    #[arg(
        long = "endpoint-mode",
        value_name = "NAME=live|test",
        env = "INBOX_ENDPOINT_MODES",
        value_delimiter = ';'
    )]
    pub endpoint_modes: Vec<String>,

    /// Largest accepted age (or future skew) of a signature timestamp; 0 is refused.
    #[arg(long, env = "INBOX_SIGNATURE_TOLERANCE", default_value = "5m", value_parser = parse_duration)]
    pub tolerance: Duration,

    /// Largest accepted body; larger requests get 413 before any verification.
    #[arg(long, env = "INBOX_MAX_BODY", default_value = "1MiB", value_parser = parse_byte_size)]
    pub max_body: u64,

    /// Most request-body bytes held at once, from the first byte received until the event's batch
    /// is written: a body takes room as its bytes arrive, never for bytes only declared; past the
    /// bound it waits (up to --db-timeout, then 503 with Retry-After) instead of the process
    /// growing, under slow senders or a slow database alike.
    #[arg(long, env = "INBOX_MAX_BYTES_IN_FLIGHT", default_value = "32MiB", value_parser = parse_byte_size)]
    pub max_bytes_in_flight: u64,

    /// Most connections served at once; more wait in the listen backlog. Each may hold ~0.25 MiB
    /// (at worst ~0.5 MiB) of request buffered by the HTTP layer, outside --max-bytes-in-flight:
    /// the two together bound the process's memory under slow or hostile clients
    /// (docs/operations.md).
    #[arg(long, env = "INBOX_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,

    /// Also store every verified body byte for byte, with the signature that matched, as evidence
    /// (`inbox-worker verify --event-id` re-checks it). Costs WAL and table space per event
    /// (docs/operations.md measures it).
    #[arg(long, env = "INBOX_KEEP_RAW")]
    pub keep_raw: bool,

    /// Most database connections; all but two is how many group-commit batches may be in flight.
    /// Connected directly, the batches share one connection, sent behind each other; behind
    /// `--db-pooler transaction` each takes one [default: 2 per core + 2, at least 6].
    #[arg(long, env = "INBOX_POOL_SIZE")]
    pub pool_size: Option<usize>,

    /// Bound on waiting for a connection plus running the insert; past it the answer is 503.
    #[arg(long, env = "INBOX_DB_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub db_timeout: Duration,

    /// Bound on receiving a request body; a client that trickles it slower gets 408.
    #[arg(long, env = "INBOX_BODY_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub body_timeout: Duration,

    /// Slowest average rate a body may arrive at, in bytes per second (e.g. 64KiB): after its
    /// first second, a body behind this rate gets 408 — a sender that declares a large body and
    /// sends little of it holds a connection no longer than that.
    #[arg(long, env = "INBOX_MIN_BODY_RATE", default_value = "64KiB", value_parser = parse_byte_size)]
    pub min_body_rate: u64,

    /// Accept webhooks only from these networks (CIDR or address, comma-separated), e.g. Stripe's
    /// published webhook addresses; others get 403 before their body is read. Health, readiness
    /// and metrics are not restricted. Default: from anywhere (the signature is the check).
    #[arg(long, env = "INBOX_ALLOW_FROM", value_name = "CIDR[,CIDR…]", value_delimiter = ',',
          value_parser = parse_network)]
    pub allow_from: Vec<ipnet::IpNet>,

    /// Proxies of yours in front of the ingest (CIDR or address, comma-separated): only from them
    /// is X-Forwarded-For read, from the right, for --allow-from (docs/operations.md, "Security").
    #[arg(long, env = "INBOX_TRUSTED_PROXIES", value_name = "CIDR[,CIDR…]", value_delimiter = ',',
          value_parser = parse_network)]
    pub trusted_proxies: Vec<ipnet::IpNet>,

    /// What is between this process and PostgreSQL: `none` (the server, or a session-mode pool)
    /// or `transaction` (a transaction-mode pool such as PgBouncer's: no statement is kept from
    /// one transaction to the next).
    #[arg(long, env = "INBOX_DB_POOLER", default_value = "none", value_name = "none|transaction")]
    pub db_pooler: Pooler,

    /// Log format [default: text on a terminal, else json].
    #[arg(long, env = "LOG_FORMAT", value_name = "json|text")]
    pub log_format: Option<LogFormat>,

    /// Secrets given as flags rather than from the environment or a file: warned about at start.
    #[arg(skip)]
    pub secret_flags: Vec<String>,
}

/// Connections served at once by default (`--max-connections`). The HTTP layer reads up to 128 KiB
/// ahead of the handler on each (and holds up to ~0.5 MiB at worst, ~0.25 MiB measured): 256 of
/// them are 64 MiB (128 at worst) beside the 32 MiB of `--max-bytes-in-flight`, inside the pod's
/// 256 Mi (docs/operations.md, "Memory"); and 256 connections carry thousands of requests a second.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// The HTTP layer's connection limit, apart from [`Settings`]: an application built with
/// [`crate::Application::build`] gets [`ConnectionLimits::default`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections served at once, over all of the server's threads.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits { max_connections: DEFAULT_MAX_CONNECTIONS }
    }
}

/// Validated settings of the service. Holds secrets: its Debug output redacts them.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the inbox lives and how to reach it (its Debug output redacts the password).
    pub database: DatabaseConfig,
    /// The endpoints served, with their secrets.
    pub endpoints: Vec<EndpointSpec>,
    pub tolerance: Duration,
    pub max_body: usize,
    /// Bound on the request-body bytes held, from the first byte received until the batch is
    /// written: the ingest's memory for bodies under slow senders or a slow database, whatever
    /// the size of the events.
    pub max_bytes_in_flight: u64,
    pub pool_size: usize,
    pub db_timeout: Duration,
    pub body_timeout: Duration,
    /// Slowest average rate a body may arrive at after its first second, bytes per second.
    pub min_body_rate: u64,
    /// Who may deliver webhooks, and which proxies' X-Forwarded-For is believed.
    pub sources: SourcePolicy,
    /// Store each verified body's exact bytes and matching signature (`--keep-raw`).
    pub keep_raw: bool,
    /// Whether the server reacts to SIGTERM/SIGINT itself (the binary) or is stopped by its
    /// owner (tests running several servers in one process).
    pub handle_signals: bool,
}

impl Cli {
    /// Parses the process's arguments (a usage error exits with status 2), noting the secrets
    /// given as flags ([`Cli::secret_flags`]).
    pub fn parse_args() -> Cli {
        use clap::parser::ValueSource;
        use clap::{CommandFactory as _, FromArgMatches as _};
        let matches = Cli::command().get_matches();
        let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        let on_command_line = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
        if on_command_line("endpoints") {
            cli.secret_flags.push(inbox_domain::config::secret_flag_warning(
                "--endpoint",
                "INBOX_ENDPOINTS or --endpoints-file",
            ));
        }
        if on_command_line("database_url") && inbox_domain::db::conninfo::names_a_password(&cli.database_url)
        {
            cli.secret_flags.push(inbox_domain::config::secret_flag_warning(
                "--database-url with a password",
                "DATABASE_URL, DATABASE_PASSWORD_FILE or a pgpass file",
            ));
        }
        cli
    }

    /// The connection limits asked for (refuses 0).
    pub fn connection_limits(&self) -> anyhow::Result<ConnectionLimits> {
        if self.max_connections == 0 {
            anyhow::bail!("--max-connections / INBOX_MAX_CONNECTIONS must be at least 1");
        }
        Ok(ConnectionLimits { max_connections: self.max_connections })
    }

    /// Checks everything that can be checked before touching the network.
    pub fn into_settings(self) -> anyhow::Result<Settings> {
        let mut database = inbox_domain::db::parse_database_url(&self.database_url)?;
        database.pooler = self.db_pooler;
        let mut endpoints = load_endpoints(&self.endpoints, self.endpoints_file.as_deref())?;
        apply_endpoint_modes(&mut endpoints, &self.endpoint_modes)
            .context("invalid endpoint configuration")?;
        if self.tolerance.is_zero() {
            anyhow::bail!(
                "--tolerance / INBOX_SIGNATURE_TOLERANCE must be above 0 (0 would disable the freshness check)"
            );
        }
        if self.db_timeout.is_zero() {
            anyhow::bail!("--db-timeout / INBOX_DB_TIMEOUT must be above 0");
        }
        let max_body = usize::try_from(self.max_body)
            .ok()
            .filter(|m| *m > 0)
            .context("--max-body must be between 1 byte and the address space")?;
        if self.max_bytes_in_flight < self.max_body {
            anyhow::bail!(
                "--max-bytes-in-flight / INBOX_MAX_BYTES_IN_FLIGHT must be at least --max-body ({} bytes), \
                 or the largest accepted event could never be stored",
                self.max_body
            );
        }
        if self.min_body_rate == 0 {
            anyhow::bail!("--min-body-rate / INBOX_MIN_BODY_RATE must be above 0");
        }
        if !self.trusted_proxies.is_empty() && self.allow_from.is_empty() {
            anyhow::bail!(
                "--trusted-proxies / INBOX_TRUSTED_PROXIES is only read for --allow-from / INBOX_ALLOW_FROM, \
                 which is not set"
            );
        }
        let pool_size = match self.pool_size {
            Some(0) => anyhow::bail!("--pool-size / INBOX_POOL_SIZE must be at least 1"),
            Some(n) => n,
            None => default_pool_size(),
        };
        Ok(Settings {
            database,
            endpoints,
            tolerance: self.tolerance,
            max_body,
            max_bytes_in_flight: self.max_bytes_in_flight,
            pool_size,
            db_timeout: self.db_timeout,
            body_timeout: self.body_timeout,
            min_body_rate: self.min_body_rate,
            sources: SourcePolicy { allow: self.allow_from, trusted_proxies: self.trusted_proxies },
            keep_raw: self.keep_raw,
            handle_signals: true,
        })
    }
}

/// Two writers per core (at least four) plus two connections for readiness checks and the
/// workers' wake-up. Every writer has a batch in flight: enough writers keep PostgreSQL's commit
/// pipeline full while one batch waits on fsync, and fewer make each batch bigger — on 2 cores,
/// 14 writers gave 4900 req/s at 32 connections and 4 gave 6200 (docs/performance.md). Connected
/// directly, the writers' batches share one connection (`crate::batcher`).
pub fn default_pool_size() -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    (cores * 2).max(4) + 2
}
