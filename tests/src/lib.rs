//! Helpers for the end-to-end tests: a database per test, the service in-process or as a
//! process, signed events, and a TCP proxy that can refuse or swallow database connections.
//!
//! Every test needs `DATABASE_URL` pointing at a PostgreSQL where it may create databases
//! (`make test` starts a local one and sets it).

pub mod app;
pub mod db;
pub mod events;
pub mod process;
pub mod proxy;
pub mod worker;

pub use app::{spawn_app, spawn_app_with, TestApp};
pub use db::TestDb;
