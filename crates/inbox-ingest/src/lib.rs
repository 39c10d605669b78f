//! `inbox-ingest`: the HTTP service that receives Stripe webhooks.
//!
//! A request is answered 200 only once its row (or the proof it already existed) is committed;
//! anything unverified is refused before it reaches the database. [`Application`] is built from
//! [`Settings`] on an already-bound listener: [`startup`] wires the [`routes`] (verify, then store
//! through the group-commit `batcher`), the [`error`] enum that maps every refusal to its status
//! code, the [`metrics`] and `/readyz`'s [`readiness`].

#[doc(hidden)]
pub mod batcher;
pub mod configuration;
pub mod error;
pub mod log_limit;
pub mod metrics;
pub mod readiness;
pub mod routes;
pub mod sources;
pub mod startup;

pub use configuration::{Cli, ConnectionLimits, Settings};
pub use startup::{Application, ServerHandle};
