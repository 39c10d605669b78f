use std::net::TcpListener;
use std::process::ExitCode;

use anyhow::Context as _;
use inbox_ingest::{Application, Cli};

fn main() -> ExitCode {
    let cli = Cli::parse_args();
    inbox_domain::telemetry::init_tracing(cli.log_format);
    for warning in &cli.secret_flags {
        tracing::warn!("{warning}");
    }
    match actix_web::rt::System::new().block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "inbox-ingest stopped");
            eprintln!("inbox-ingest: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let listen = cli.listen.clone();
    let limits = cli.connection_limits()?;
    let settings = cli.into_settings()?;
    let listener = TcpListener::bind(&listen).with_context(|| format!("binding {listen}"))?;
    let endpoints: Vec<String> = settings.endpoints.iter().map(|e| e.name.clone()).collect();
    let address = listener.local_addr()?;
    let app = Application::build_with(settings, limits, listener).await?;
    tracing::info!(listen = %address, ?endpoints, "inbox-ingest serving");
    app.run_until_stopped().await.context("serving")?;
    tracing::info!("inbox-ingest stopped cleanly");
    Ok(())
}
