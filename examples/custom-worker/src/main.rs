//! `custom-worker`: a team's own worker binary. The stock invoice handlers, plus the team's
//! subscription state machine ([`subscriptions`]) and its handler of Stripe's thin events
//! ([`thin`]: it records the current state of the object they name, which `fetch` fetched before
//! the handler runs), each with its table and migrations; every subcommand of `inbox-worker`
//! (`migrate`, `run`, `fetch`, `replay`, the operator commands) comes from
//! `inbox_worker::main_with`.
//!
//! Configuration: `SUBSCRIPTION_PRICES`, the comma-separated Stripe price ids this product sells
//! (unset: every subscription). A malformed value stops the binary before it does anything.

use std::process::ExitCode;

use inbox_worker::prelude::*;

mod subscriptions;
mod thin;

use subscriptions::{Prices, SubscriptionHandler};
use thin::RecordObject;

fn main() -> ExitCode {
    let prices = match Prices::from_env() {
        Ok(prices) => prices,
        Err(e) => {
            eprintln!("custom-worker: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let subscriptions = SubscriptionHandler::new(prices);
    let mut registry = Registry::with_invoice_handlers();
    for event_type in subscriptions::EVENT_TYPES {
        registry.register(event_type, subscriptions.clone());
    }
    // Thin events: applied by `custom-worker fetch` once it has fetched the object they name;
    // `custom-worker run` leaves them.
    for event_type in thin::EVENT_TYPES {
        registry.register_fetched(event_type, RecordObject);
    }
    // Applied by `migrate` after the inbox's own migrations, recorded in a history table of its own.
    registry.migrations(
        Migrations::new("custom_worker_schema_history")
            .add("V1__subscriptions", include_str!("../migrations/V1__subscriptions.sql"))
            .add("V2__stripe_fetches", include_str!("../migrations/V2__stripe_fetches.sql"))
            .add("V3__stripe_objects", include_str!("../migrations/V3__stripe_objects.sql")),
    );
    inbox_worker::main_with(registry)
}
