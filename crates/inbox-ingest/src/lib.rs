//! `inbox-ingest`: the HTTP service that receives Stripe webhooks.
//!
//! A request is answered 200 only once its row (or the proof it already existed) is committed;
//! anything unverified is refused before it reaches the database.

pub mod batcher;
pub mod configuration;
pub mod error;
pub mod metrics;
pub mod routes;
pub mod startup;

pub use configuration::{Cli, Settings};
pub use startup::Application;
