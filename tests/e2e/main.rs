//! End-to-end tests: real PostgreSQL (a database per test), real HTTP, the built binaries.
//! One test binary, so the workspace links it once.

mod after_crash;
mod bad_input;
mod broken_orderings;
mod connection;
mod console;
mod console_actions;
mod console_browser;
mod docs;
mod endpoint_watchdog;
mod failover;
mod group_commit;
mod hardening;
mod hygiene;
mod ingest_faults;
mod ingest_http;
mod ingest_memory;
mod ingest_process;
mod invoice_order;
mod kept;
mod metric_names;
mod migrate;
mod operator;
mod pgbouncer;
mod reconcile;
mod reconciliation;
mod regressions;
mod relay;
mod relay_nats;
mod roles;
mod stripe_client;
mod stripe_shapes;
mod tls;
mod worker_health;
mod worker_process;
mod worker_semantics;
