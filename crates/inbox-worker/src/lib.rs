//! `inbox-worker`: applies the inbox's events to the business tables exactly once, and the
//! operator commands. The stock binary runs the invoice handlers; a team's own binary runs its
//! own, with every subcommand (`run`, `replay`, the operator commands, `migrate`), in a few lines:
//!
//! ```no_run
//! use inbox_worker::prelude::*;
//!
//! /// Counts new customers in a table of the team's own (created by its migration below).
//! struct RecordCustomer {
//!     source: String,
//! }
//!
//! impl Handler for RecordCustomer {
//!     fn handle<'a>(&'a self, tx: &'a Transaction<'_>, event: &'a InboxEvent) -> HandlerFuture<'a> {
//!         Box::pin(async move {
//!             let customer = event.object_str("id")?;
//!             tx.execute(
//!                 "INSERT INTO seen_customers (id, source) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
//!                 &[&customer, &self.source],
//!             )
//!             .await?;
//!             Ok(())
//!         })
//!     }
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let mut registry = Registry::with_invoice_handlers(); // or Registry::new()
//!     registry
//!         .register("customer.created", RecordCustomer { source: "stripe".into() })
//!         .migrations(Migrations::new("app_schema_history").add(
//!             "V1__seen_customers",
//!             "CREATE TABLE seen_customers (id text PRIMARY KEY, source text NOT NULL)",
//!         ));
//!     inbox_worker::main_with(registry)
//! }
//! ```
//! `examples/custom-worker` is a complete one, with its tests; `docs/handlers.md` says how to
//! write a handler.
//!
//! # Inside
//! `run` is River's division of labour: the [`runner`] wires the `producer` (claims rows,
//! transaction 1), the `executor` (runs a batch and marks it processed, transaction 2) and the
//! `completer` (records failures, transaction 3), with the wake-up `listener`, the `metrics`
//! and the shutdown signal, and the `statistics` check that analyses the queue tables after
//! PostgreSQL lost its statistics (a crash restart). Each operator command is a module of `ops`.
//! Every SQL statement on the inbox is in `inbox_domain::inbox::store`.

use std::process::ExitCode;

use inbox_domain::handler::Registry;

mod cli;
#[doc(hidden)]
pub mod completer;
#[doc(hidden)]
pub mod conn;
pub mod console;
#[doc(hidden)]
pub mod executor;
pub mod fetch;
mod listener;
#[doc(hidden)]
pub mod metrics;
mod ops;
#[doc(hidden)]
pub mod producer;
#[doc(hidden)]
pub mod relay;
#[doc(hidden)]
pub mod runner;
mod statistics;
pub mod stripe;

/// What a handler needs, and what a worker binary registers.
pub mod prelude {
    pub use crate::fetch::{snapshot, Snapshot};
    pub use deadpool_postgres::Transaction;
    pub use inbox_domain::handler::{BatchHandler, Handler, HandlerError, HandlerFuture, Registry};
    pub use inbox_domain::inbox::event::{InboxEvent, RelatedObject};
    pub use inbox_domain::inbox::schema::Migrations;
}

/// The whole worker binary with `registry`'s handlers and migrations: parses the command line
/// (every subcommand), sets up logging, runs the command and returns the exit status — 0 on
/// success, 1 on a runtime failure (the cause on stderr), 2 on a usage error. `run` and `replay`
/// apply the same handlers; `migrate` applies the inbox's migrations, then the registry's.
pub fn main_with(registry: Registry) -> ExitCode {
    let name = program_name();
    let cli = cli::Cli::parse_as(&name);
    inbox_domain::telemetry::init_tracing(cli.global.log_format);
    for warning in &cli.global.secret_flags {
        tracing::warn!("{warning}");
    }
    // One thread: a worker waits on PostgreSQL, and a multi-threaded scheduler's wake-ups cost
    // more CPU per event than they save (docs/performance.md).
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let json = cli.command.json();
    match runtime.block_on(dispatch(cli, registry, &name)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e:#}");
            if json && e.downcast_ref::<ops::output::AfterReport>().is_none() {
                // One document on stdout, as on success, for the script that parses it.
                println!("{}", serde_json::json!({ "error": format!("{e:#}") }));
            }
            ExitCode::FAILURE
        }
    }
}

/// The binary's file name, for help and error messages.
fn program_name() -> String {
    std::env::args_os()
        .next()
        .and_then(|arg0| std::path::Path::new(&arg0).file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "inbox-worker".to_owned())
}

/// Runs the parsed command.
async fn dispatch(cli: cli::Cli, mut registry: Registry, program: &str) -> anyhow::Result<()> {
    // Printing a users-file line needs no database.
    if let cli::Command::Console(console::ConsoleArgs {
        action: Some(console::ConsoleAction::HashPassword(args)),
        ..
    }) = &cli.command
    {
        return console::hash_password(args);
    }
    let url = cli
        .global
        .database_url
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("no database: set DATABASE_URL or pass --database-url"))?;
    let mut database = inbox_domain::db::parse_database_url(url)?;
    database.pooler = cli.global.db_pooler;
    match cli.command {
        cli::Command::Run(args) => {
            for pattern in args.ignore.iter().filter(|p| !p.trim().is_empty()) {
                let pattern = pattern.parse().map_err(|e| anyhow::anyhow!("--ignore / INBOX_IGNORE: {e}"))?;
                registry.ignore_pattern(pattern);
            }
            // Thin events whose handler needs their object are `fetch`'s: an ignore pattern that
            // covers one would have `run` mark it processed with no effect, and it would be lost.
            for fetched in registry.fetched_types() {
                if let Some(pattern) = registry.ignore_patterns().iter().find(|p| p.matches(fetched)) {
                    anyhow::bail!(
                        "the ignore pattern {pattern} (--ignore / INBOX_IGNORE / Registry::ignore) covers \
                         {fetched}, which {program} applies with `fetch` (Registry::register_fetched): `run` \
                         would mark it processed without its handler. Use patterns that leave it out \
                         (a prefix such as customer.*, or the types one by one)"
                    );
                }
            }
            let mut settings = runner::Settings::from_args(database, args.max_attempts, &args)?;
            settings.program = program.to_owned();
            runner::run(settings, registry.without_fetched(), runner::os_signals()).await
        }
        cli::Command::Console(args) => console::run(args, database, registry).await,
        cli::Command::Fetch(args) => {
            if args.run.ignore.iter().any(|p| !p.trim().is_empty()) {
                tracing::warn!(
                    "fetch applies only the types registered with Registry::register_fetched: \
                     --ignore / INBOX_IGNORE does not apply to it"
                );
            }
            let fetched = registry.only_fetched();
            anyhow::ensure!(
                !fetched.event_types().is_empty(),
                "{program} registers no event type with Registry::register_fetched: nothing for fetch to apply"
            );
            let mut settings = runner::Settings::from_args(database, args.run.max_attempts, &args.run)?;
            settings.program = program.to_owned();
            let db_timeout = args.run.statement_timeout.max(std::time::Duration::from_secs(5));
            settings.fetcher = Some(std::sync::Arc::new(fetch::Fetcher::new(
                args.stripe.client()?,
                args.max_fetches,
                db_timeout,
                args.run.lease,
            )));
            runner::run(settings, fetched, runner::os_signals()).await
        }
        cli::Command::Relay(args) => {
            let settings = relay::Settings::from_args(database, &args)?;
            relay::run(settings, runner::os_signals()).await
        }
        command => ops::execute(command, database, &registry).await,
    }
}
