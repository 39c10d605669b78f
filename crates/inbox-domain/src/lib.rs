//! The domain of stripe-inbox, shared by `inbox-ingest` and `inbox-worker`.
//!
//! * [`signature`]: Stripe's `Stripe-Signature` scheme, verified on the raw body.
//! * [`event`]: the two fields the ingest needs from a verified body, and its JSON as a parameter.
//! * [`store`]: every SQL statement on `webhook_inbox`, each a documented constant.
//! * [`schema`]: the embedded migrations and the schema version this build expects.
//! * [`db`]: the connection pool both binaries use.
//! * [`config`]: configuration pieces both binaries share (endpoints, secrets, logging).

pub mod config;
pub mod db;
pub mod event;
pub mod handlers;
pub mod schema;
pub mod signature;
pub mod store;

pub use event::{EventHead, EventHeadError, JsonBytes};
pub use signature::{SignatureError, Verifier};

/// The provider column of every row this service writes.
pub const PROVIDER_STRIPE: &str = "stripe";
