//! `inbox-worker`: the claim/process loop and the operator commands.

pub mod cli;
pub mod migrate;

pub use cli::Cli;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let url = cli
        .global
        .database_url
        .as_deref()
        .ok_or_else(|| anyhow::anyhow!("no database: set DATABASE_URL or pass --database-url"))?;
    let database = inbox_domain::db::parse_database_url(url)?;
    match cli.command {
        cli::Command::Migrate => migrate::run(database).await,
    }
}
