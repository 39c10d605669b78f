//! End-to-end tests: real PostgreSQL (a database per test), real HTTP, the built binaries.
//! One test binary, so the workspace links it once.

mod ingest_faults;
mod ingest_http;
mod ingest_process;
mod migrate;
