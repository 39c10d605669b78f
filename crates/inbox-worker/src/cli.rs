//! The command line of a worker binary: the global flags, one subcommand per command, and the
//! flags of `run` (each operator command's flags live in its own file under `ops/`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use inbox_domain::config::{parse_byte_size, parse_duration};
use inbox_domain::db::Pooler;
use inbox_domain::telemetry::LogFormat;

use crate::ops;

/// Applies inbox events to the business tables exactly once, and the operator commands.
#[derive(Debug, Parser)]
#[command(name = "inbox-worker", version, about, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Parses the process's arguments, naming the program `name` in help and errors (a team's
    /// own binary is not called `inbox-worker`). A usage error exits with status 2.
    pub fn parse_as(name: &str) -> Cli {
        let matches = Cli::command().name(name.to_owned()).bin_name(name.to_owned()).get_matches();
        let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        // Global flags are seen at the top and in the subcommand, wherever they were written.
        let on_command_line = |id: &str| {
            let here =
                |m: &clap::ArgMatches| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
            here(&matches) || matches.subcommand().is_some_and(|(_, sub)| here(sub))
        };
        if on_command_line("database_url")
            && cli.global.database_url.as_deref().is_some_and(inbox_domain::db::conninfo::names_a_password)
        {
            cli.global.secret_flags.push(inbox_domain::config::secret_flag_warning(
                "--database-url with a password",
                "DATABASE_URL, DATABASE_PASSWORD_FILE or a pgpass file",
            ));
        }
        if matches.subcommand_matches("relay").is_some_and(|relay| {
            relay.value_source("signing_secret") == Some(clap::parser::ValueSource::CommandLine)
        }) {
            cli.global.secret_flags.push(inbox_domain::config::secret_flag_warning(
                "--signing-secret",
                "INBOX_RELAY_SECRET or --signing-secret-file",
            ));
        }
        if let Some((name, sub)) = matches.subcommand() {
            if sub.try_get_one::<String>("api_key").is_ok_and(|v| v.is_some())
                && sub.value_source("api_key") == Some(clap::parser::ValueSource::CommandLine)
            {
                cli.global.secret_flags.push(inbox_domain::config::secret_flag_warning(
                    &format!("{name} --api-key"),
                    "STRIPE_API_KEY or --api-key-file",
                ));
            }
        }
        if matches.subcommand_matches("verify").is_some_and(|verify| {
            verify.value_source("secrets") == Some(clap::parser::ValueSource::CommandLine)
        }) {
            cli.global.secret_flags.push(inbox_domain::config::secret_flag_warning(
                "--secrets",
                "INBOX_ENDPOINTS or --secrets-file",
            ));
        }
        cli
    }
}

/// Flags every subcommand takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// PostgreSQL connection string (URL or key=value).
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// What is between this process and PostgreSQL: `none` (the server, or a session-mode pool)
    /// or `transaction` (a transaction-mode pool such as PgBouncer's: workers then poll instead of
    /// LISTENing, and `migrate` is refused: it needs a session).
    #[arg(
        long,
        global = true,
        env = "INBOX_DB_POOLER",
        default_value = "none",
        value_name = "none|transaction"
    )]
    pub db_pooler: Pooler,

    /// Log format [default: text on a terminal, else json].
    #[arg(long, global = true, env = "LOG_FORMAT", value_name = "json|text")]
    pub log_format: Option<LogFormat>,

    /// Secrets given as flags rather than from the environment or a file: warned about at start.
    #[arg(skip)]
    pub secret_flags: Vec<String>,
}

/// One variant per command; each operator command is a module of [`crate::ops`].
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations, the inbox's then this binary's own (safe to run repeatedly
    /// and concurrently).
    Migrate,
    /// Process inbox rows until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Queue health: unprocessed, ready, leased, oldest age, needs review, processed last hour.
    Stats(ops::stats::Args),
    /// List parked rows (attempts at the limit), oldest first.
    NeedsReview(ops::needs_review::Args),
    /// Put parked rows back in the queue (attempts = 0, available now).
    Requeue(ops::requeue::Args),
    /// Run an already processed event again with this binary's handler (handlers are idempotent:
    /// this repairs, never double-books).
    Replay(ops::replay::Args),
    /// Close a parked or held row without processing it (kept, with the reason, audited).
    Dismiss(ops::dismiss::Args),
    /// Delete processed rows older than an age, in batches.
    Purge(ops::purge::Args),
    /// Rebuild the queue table's and the outbox's indexes that grew well past their contents (after
    /// a long snapshot elsewhere), without blocking writers; run as the tables' owner.
    Reindex(ops::reindex::Args),
    /// Check a stored event against the signature kept with its raw body (ingest --keep-raw):
    /// which configured secret made it, and that the payload is the signed body.
    Verify(ops::verify::Args),
    /// List the reconciliation items a person must settle (open ones; --all for every one), or
    /// close one: `reconciliation resolve --id N --note TEXT` (audited).
    Reconciliation(ops::reconciliation::Args),
    /// Serve the operators' web page (overview, needs review, event detail, outbox,
    /// reconciliation, audit log, and the actions), or print a users-file line (`hash-password`).
    Console(crate::console::ConsoleArgs),
    /// Apply the thin events whose handler needs their object (Registry::register_fetched):
    /// fetch each object once per burst, keep the snapshot, then process like `run`.
    Fetch(crate::fetch::FetchArgs),
    /// Store the events Stripe's API lists that the inbox lacks for an endpoint (an outage, a
    /// disabled endpoint, a database failover); resumes an interrupted run.
    Reconcile(ops::reconcile::Args),
    /// Deliver outbox rows to an HTTP receiver (Standard Webhooks signing) or NATS JetStream
    /// until SIGTERM/SIGINT, and mark them published.
    Relay(crate::relay::RelayArgs),
}

impl Command {
    /// Whether the command was asked for JSON (`--json`): its errors are then a JSON document on
    /// stdout too, for the script that reads it.
    pub fn json(&self) -> bool {
        match self {
            Command::Stats(a) => a.output.json,
            Command::NeedsReview(a) => a.output.json,
            Command::Requeue(a) => a.output.json,
            Command::Replay(a) => a.output.json,
            Command::Dismiss(a) => a.output.json,
            Command::Purge(a) => a.output.json,
            Command::Reindex(a) => a.output.json,
            Command::Verify(a) => a.output.json,
            Command::Reconciliation(a) => a.json(),
            Command::Reconcile(a) => a.output.json,
            Command::Migrate
            | Command::Run(_)
            | Command::Relay(_)
            | Command::Fetch(_)
            | Command::Console(_) => false,
        }
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Events in flight at once in this process. --concurrency / --batch-size transactions (and
    /// connections) run at once: 4 by default.
    #[arg(long, env = "INBOX_WORKER_CONCURRENCY", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub concurrency: u32,

    /// Events processed per transaction (capped at --concurrency); a claim takes up to one batch
    /// per free transaction. Larger batches mean fewer commits, statements and PostgreSQL CPU per
    /// event.
    #[arg(long, env = "INBOX_WORKER_BATCH", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub batch_size: u32,

    /// Payload bytes in flight at most (e.g. 32MiB): what bounds the worker's memory whatever the
    /// size of the events (a claim takes fewer rows when they are large, and at least one).
    #[arg(long, env = "INBOX_WORKER_MAX_BYTES_IN_FLIGHT", default_value = "32MiB",
          value_parser = parse_byte_size)]
    pub max_bytes_in_flight: u64,

    /// Attempts after which a worker parks a row for review: never claimed again until requeued.
    /// (The operator commands see parked rows as the workers left them: they take no limit.)
    #[arg(long, env = "INBOX_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,

    /// How long a claimed row stays invisible to other workers.
    #[arg(long, env = "INBOX_LEASE", default_value = "2m", value_parser = parse_duration)]
    pub lease: Duration,

    /// Bound on each statement of a handler; must be at most half the lease.
    #[arg(long, env = "INBOX_STATEMENT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub statement_timeout: Duration,

    /// How often an idle worker looks for ready rows (it also wakes when rows arrive).
    #[arg(long, env = "INBOX_POLL_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub poll_interval: Duration,

    /// Serve Prometheus metrics (and /healthz) on this address, e.g. 0.0.0.0:9090.
    #[arg(long, env = "INBOX_WORKER_METRICS", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,

    /// Event types to mark processed with no effect, besides those this binary handles: `*`,
    /// `prefix.*` or one type, comma-separated (a handled type is always handled). A type neither
    /// handled nor ignored is never claimed: it waits for a worker that handles it, counted by
    /// `stats` as no_handler.
    #[arg(long, env = "INBOX_IGNORE", value_delimiter = ',', value_name = "PATTERN[,PATTERN…]")]
    pub ignore: Vec<String>,

    /// After SIGTERM/SIGINT, how long in-flight events may take to finish.
    #[arg(long, env = "INBOX_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
}

/// How a command reaches Stripe's API (`reconcile`, `fetch`).
#[derive(Debug, Args, Clone)]
pub struct StripeArgs {
    /// Stripe API key: a restricted key (rk_…) with read access to what the command reads (Events
    /// for reconcile; the objects thin events name for fetch) is enough. Prefer STRIPE_API_KEY or
    /// --api-key-file: a flag shows in the process list.
    #[arg(long, env = "STRIPE_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub api_key: Option<String>,

    /// A file holding the API key (a mounted secret); read at start.
    #[arg(long, env = "STRIPE_API_KEY_FILE", value_name = "PATH")]
    pub api_key_file: Option<std::path::PathBuf>,

    /// Where Stripe's API is (a local server in tests).
    #[arg(long, env = "STRIPE_API_BASE", default_value = crate::stripe::DEFAULT_API_BASE, value_name = "URL")]
    pub api_base: String,

    /// Stripe-Version to ask for [default: the account's]. Events keep the version they were
    /// created with; fetched objects follow this.
    #[arg(long, env = "STRIPE_API_VERSION", value_name = "VERSION")]
    pub api_version: Option<String>,

    /// How long one request to Stripe may take (it is retried after that).
    #[arg(long, env = "STRIPE_API_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub api_timeout: Duration,
}

impl StripeArgs {
    /// The client these flags describe; refuses a missing or malformed key without echoing it.
    pub fn client(&self) -> anyhow::Result<crate::stripe::Client> {
        let key = match (&self.api_key, &self.api_key_file) {
            (Some(key), None) => key.clone(),
            (None, Some(path)) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("reading --api-key-file {}: {e}", path.display()))?,
            (Some(_), Some(_)) => anyhow::bail!("give the Stripe API key once: --api-key (STRIPE_API_KEY) or --api-key-file"),
            (None, None) => anyhow::bail!(
                "no Stripe API key: set STRIPE_API_KEY or --api-key-file (a restricted rk_… key with read access is enough)"
            ),
        };
        let key = crate::stripe::ApiKey::new(&key).map_err(|e| anyhow::anyhow!("STRIPE_API_KEY: {e}"))?;
        let mut config = crate::stripe::Config::new(key);
        config.base = self.api_base.clone();
        config.timeout = self.api_timeout;
        config.api_version = self.api_version.clone().filter(|v| !v.trim().is_empty());
        crate::stripe::Client::new(config)
    }
}
