//! `inbox-worker`'s command line.

use clap::{Args, Parser, Subcommand};
use inbox_domain::config::LogFormat;

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

    /// Log format [default: text on a terminal, else json].
    #[arg(long, global = true, env = "LOG_FORMAT", value_name = "json|text")]
    pub log_format: Option<LogFormat>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations (safe to run repeatedly and concurrently).
    Migrate,
}
