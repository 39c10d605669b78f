//! `migrate`: applies the inbox's migrations, then this binary's own (see
//! `inbox_domain::inbox::schema`), and says what it did — the versions applied, and what the
//! server said while applying them.
//!
//! A migration that cannot do all it would (V18 on a server without lz4, V22 run by a role that
//! may not change the database's settings) goes on and says so with `RAISE NOTICE`, naming what
//! was left and the statement that finishes it. The server sends such notices beside the
//! statement's result; tokio-postgres hands them to whoever drives the connection, and a pooled
//! connection's driver would only log them at `info`, below the default level. So `migrate` opens
//! a connection of its own, drives it itself, and prints each notice after the versions applied.
//! PostgreSQL's own notices from idempotent DDL ("… already exists, skipping", which refinery's
//! `CREATE TABLE IF NOT EXISTS` of its history table raises on every run) say nothing done or
//! left to do, and are not printed.

use futures_util::StreamExt as _;
use inbox_domain::db::{describe_db_error, DatabaseConfig};
use inbox_domain::handler::Registry;
use inbox_domain::inbox::schema;
use tokio_postgres::error::DbError;
use tokio_postgres::AsyncMessage;

use super::output::emit;
use super::{APPLICATION_NAME, CONNECT_TIMEOUT};

/// `migrate`.
pub async fn run(mut database: DatabaseConfig, registry: &Registry) -> anyhow::Result<()> {
    if database.config.get_connect_timeout().is_none() {
        database.config.connect_timeout(CONNECT_TIMEOUT);
    }
    let (mut client, mut connection) =
        database.open(APPLICATION_NAME).await.map_err(|e| database.unreachable(describe_db_error(&e)))?;
    let (notices, mut said) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notice(notice)) => {
                    let _ = notices.send(notice);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %describe_db_error(&e), "database connection closed");
                    break;
                }
            }
        }
    });
    let reports = schema::migrate(&mut client, registry.app_migrations()).await;
    // A notice arrives before the result of the statement that raised it, and the driver forwards
    // it as it reads it: every notice of the run is in the channel by now.
    let mut server_said = String::new();
    while let Ok(notice) = said.try_recv() {
        if let Some(line) = notice_line(&notice) {
            server_said.push_str(&line);
            server_said.push('\n');
        }
    }
    let reports = match reports {
        Ok(reports) => reports,
        // What the server said before a migration failed can be why it failed: printed before the
        // error.
        Err(e) => {
            emit(&server_said)?;
            return Err(e);
        }
    };
    let mut text = String::new();
    for report in &reports {
        // The inbox's set is "schema"; an application's is named by its history table.
        let (set, recorded_in) = match report.history_table.as_str() {
            schema::HISTORY_TABLE => ("schema".to_owned(), String::new()),
            table => (table.to_owned(), format!(" ({table})")),
        };
        for (version, name) in &report.applied {
            text.push_str(&format!("applied V{version} {name}{recorded_in}\n"));
        }
        let state = if report.applied.is_empty() { "is up to date at" } else { "is at" };
        text.push_str(&format!("{set} {state} version {}\n", report.version));
    }
    text.push_str(&server_said);
    emit(&text)
}

/// A notice as psql shows it (`NOTICE:  …`, with its detail and hint), or `None` for
/// PostgreSQL's "… already exists, skipping" and "… does not exist, skipping".
fn notice_line(notice: &DbError) -> Option<String> {
    if notice.message().ends_with(", skipping") {
        return None;
    }
    let mut line = format!("{}:  {}", notice.severity(), notice.message());
    if let Some(detail) = notice.detail() {
        line.push_str(&format!("\nDETAIL:  {detail}"));
    }
    if let Some(hint) = notice.hint() {
        line.push_str(&format!("\nHINT:  {hint}"));
    }
    Some(line)
}
