//! What the end-to-end tests, the bench and the chaos run share: a database per test cloned
//! from a migrated template ([`db`]), the ingest in-process ([`app`]) and the worker's building
//! blocks ([`worker`]), the built binaries as processes ([`process`]), realistic signed events
//! ([`events`]), a TCP proxy that can refuse or swallow database connections ([`proxy`]), a
//! PostgreSQL cluster that takes TLS connections only ([`tls`]) and a PgBouncer in transaction
//! mode ([`pgbouncer`]), an HTTP receiver for the relay ([`receiver`]) and nats-server with
//! JetStream, single or clustered ([`nats`]); the operator console as a process with its users and
//! rows worth showing ([`console`]) and, with the `browser` feature, headless Chromium to drive it
//! (`browser`).
//!
//! Every test needs `DATABASE_URL` pointing at a PostgreSQL where it may create databases
//! (`make test` starts a local one and sets it).

pub mod app;
#[cfg(feature = "browser")]
pub mod browser;
pub mod console;
pub mod db;
pub mod events;
pub mod nats;
pub mod pgbouncer;
pub mod port;
pub mod process;
pub mod proxy;
pub mod receiver;
pub mod replica;
pub mod server_user;
pub mod stripe_api;
pub mod stripe_fixtures;
pub mod tls;
pub mod worker;

pub use app::{spawn_app, spawn_app_with, TestApp};
pub use db::TestDb;
