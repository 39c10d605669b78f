//! The stock `inbox-worker`: every subcommand, with the invoice handlers.

fn main() -> std::process::ExitCode {
    inbox_worker::main_with(inbox_worker::prelude::Registry::with_invoice_handlers())
}
