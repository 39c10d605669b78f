use std::process::ExitCode;

use clap::Parser as _;
use inbox_worker::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    inbox_domain::config::init_tracing(cli.global.log_format);
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("inbox-worker: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(inbox_worker::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox-worker: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
