//! The library both binaries share, in three parts.
//!
//! **The inbox** ([`inbox`]): what a verified Stripe event is ([`inbox::event`]), Stripe's
//! signature scheme ([`inbox::signature`]), every SQL statement on `webhook_inbox`
//! ([`inbox::store`]) and the schema with its migrations ([`inbox::schema`]).
//!
//! **Handlers** ([`handler`]): the extension point — the [`handler::Handler`] trait and the
//! [`handler::Registry`] of handlers by event type — and [`invoice`], the invoice business this
//! project ships: a handler set like any application's own, registered with [`health`] (what
//! Stripe failed to send becomes work for a person) as the stock handlers.
//!
//! **Process plumbing** shared by the binaries: the connection pool ([`db`]), logging
//! ([`telemetry`]), the configuration pieces both read ([`config`]) and the bound on payload
//! bytes each holds in memory ([`budget`]).

pub mod budget;
pub mod config;
pub mod db;
pub mod handler;
pub mod health;
pub mod inbox;
pub mod invoice;
pub mod telemetry;

/// The provider column of every row this service writes.
pub const PROVIDER_STRIPE: &str = "stripe";
