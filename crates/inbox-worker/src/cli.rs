//! `inbox-worker`'s command line.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use inbox_domain::config::{parse_duration, LogFormat};

/// Applies inbox events to the business tables exactly once, and the operator commands.
#[derive(Debug, Parser)]
#[command(name = "inbox-worker", version, about, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every subcommand takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// PostgreSQL connection string (URL or key=value).
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Attempts after which a row is parked for review (never claimed again until requeued).
    #[arg(long, global = true, env = "INBOX_MAX_ATTEMPTS", default_value_t = 10,
          value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,

    /// Log format [default: text on a terminal, else json].
    #[arg(long, global = true, env = "LOG_FORMAT", value_name = "json|text")]
    pub log_format: Option<LogFormat>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations (safe to run repeatedly and concurrently).
    Migrate,
    /// Process inbox rows until SIGTERM/SIGINT.
    Run(RunArgs),
    /// Queue health: unprocessed, ready, leased, oldest age, needs review, processed last hour.
    Stats(OutputArgs),
    /// List parked rows (attempts at the limit), oldest first.
    NeedsReview(NeedsReviewArgs),
    /// Put parked rows back in the queue (attempts = 0, available now).
    Requeue(RequeueArgs),
    /// Run an already processed event again (handlers are idempotent: this repairs, never double-books).
    Replay(ReplayArgs),
    /// Delete processed rows older than an age, in batches.
    Purge(PurgeArgs),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Events in flight at once in this process.
    #[arg(long, env = "INBOX_WORKER_CONCURRENCY", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,

    /// Events claimed and processed per transaction (capped at --concurrency). Larger batches
    /// mean fewer commits, statements and PostgreSQL CPU per event; --concurrency / --batch-size
    /// transactions run at once.
    #[arg(long, env = "INBOX_WORKER_BATCH", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub batch_size: u32,

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

    /// After SIGTERM/SIGINT, how long in-flight events may take to finish.
    #[arg(long, env = "INBOX_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,
}

/// Output flags of the operator commands.
#[derive(Debug, Args, Clone)]
pub struct OutputArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Who is acting, for `operator_audit`.
#[derive(Debug, Args, Clone)]
pub struct ActorArgs {
    /// Recorded in operator_audit [default: $USER].
    #[arg(long, env = "USER", hide_env_values = false, default_value = "unknown")]
    pub actor: String,
}

#[derive(Debug, Args)]
pub struct NeedsReviewArgs {
    #[command(flatten)]
    pub output: OutputArgs,
    /// Most rows listed.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["event_id", "all"])))]
pub struct RequeueArgs {
    /// The event to requeue.
    #[arg(long)]
    pub event_id: Option<String>,
    /// The endpoint of --event-id (needed when the id is stored for several endpoints).
    #[arg(long, requires = "event_id")]
    pub endpoint: Option<String>,
    /// Every parked row (narrow with --event-type / --error-contains).
    #[arg(long, conflicts_with = "event_id")]
    pub all: bool,
    /// With --all: only rows of this event type.
    #[arg(long, requires = "all")]
    pub event_type: Option<String>,
    /// With --all: only rows whose last_error contains this text.
    #[arg(long, requires = "all")]
    pub error_contains: Option<String>,
    /// Show what would be requeued, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The processed event to run again.
    #[arg(long)]
    pub event_id: String,
    /// Its endpoint (needed when the id is stored for several endpoints).
    #[arg(long)]
    pub endpoint: Option<String>,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Delete processed rows older than this (processed_at), e.g. 30d.
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Duration,
    /// Count what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Allow an age under Stripe's 3-day retry window (a redelivery could then be applied again).
    #[arg(long)]
    pub force: bool,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
    #[command(flatten)]
    pub actor: ActorArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}
