//! `inbox-worker`: the claim/process loop and the operator commands.
//!
//! Roles (as in River): the [`producer`] claims rows, the [`executor`] runs one event and
//! returns an [`executor::Outcome`], the [`completer`] writes failures; [`runner`] wires them
//! with the wake-up [`listener`], metrics and the shutdown signal.

pub mod cli;
pub mod completer;
pub mod executor;
pub mod listener;
pub mod metrics;
pub mod migrate;
pub mod ops;
pub mod producer;
pub mod runner;

pub use cli::Cli;

use anyhow::Context as _;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let url = cli
        .global
        .database_url
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("no database: set DATABASE_URL or pass --database-url"))?;
    let database = inbox_domain::db::parse_database_url(url)?;
    let max_attempts = cli.global.max_attempts;
    match cli.command {
        cli::Command::Migrate => migrate::run(database).await,
        cli::Command::Run(args) => {
            let settings = runner::Settings::from_args(database, max_attempts, &args)?;
            runner::run(
                settings,
                inbox_domain::handlers::Registry::with_invoice_handlers(),
                runner::os_signals(),
            )
            .await
        }
        command => {
            let (mut client, connection) =
                database.connect(tokio_postgres::NoTls).await.context("cannot connect to the database")?;
            let connection = tokio::spawn(connection);
            let result = match command {
                cli::Command::Stats(a) => ops::stats(&mut client, max_attempts, &a).await,
                cli::Command::NeedsReview(a) => ops::needs_review(&mut client, max_attempts, &a).await,
                cli::Command::Requeue(a) => ops::requeue(&mut client, max_attempts, &a).await,
                cli::Command::Replay(a) => ops::replay(&database, &a).await,
                cli::Command::Purge(a) => ops::purge(&mut client, &a).await,
                cli::Command::Migrate | cli::Command::Run(_) => unreachable!("handled above"),
            };
            drop(client);
            let _ = connection.await;
            result
        }
    }
}
